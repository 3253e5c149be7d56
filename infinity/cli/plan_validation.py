"""infinity-plan --validate: the best candidate that fits, run here for real, and its prediction
set against what the run measured.

The run is the plan's own: the same model (built as the recording built it), batch, optimizer
and loop, the candidate's configuration on the swap directories the plan recorded on, in a
process of its own (``python -m infinity.cli.plan_validation --spec JSON``) so that its peak
RSS is its own. Its first :data:`WARMUP` steps are left out, as a prediction leaves out its
first replayed iterations; what is compared is the median of the measured steps' seconds, the
store's bytes read and written per step (``stats()`` counters) and the process's peak RSS,
each against the goals of :data:`infinity.cli.common.measure.GOALS`, and where the updates ran
(``stats()["update_mode"]``) against where the prediction put them.

Only what can run here can be validated: one process (no --ranks), this machine's compute (no
GPU --device-profile), the model itself (not a scaled-down copy's extrapolation), as many
swap directories as the validated table's drives, and no more host memory than this machine
has.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infinity import OffloadConfig, TieredStore
from infinity.cli.common.args import USER_ERRORS, UserError, spawn_child
from infinity.cli.common.measure import GOALS, compare, measure_steps
from infinity.cli.plan_models import (
    OPTIMIZERS,
    hf_source,
    inputs_for,
    loss_of,
    module_source,
    quiet_transformers,
)
from infinity.cli.plan_report import Plan, Table, size_text
from infinity.config import format_size
from infinity.planning import planner
from swap import SwapError

log = logging.getLogger("infinity.cli.plan_validation")

#: steps run before the measured ones: the first records the trace, the second is the first
#: one prefetch follows (the prediction leaves out the same replayed iterations)
WARMUP = planner.WARMUP
#: measured steps when --validate is given without a number
DEFAULT_STEPS = 4
#: what a failed validation run reports as one line, as infinity-plan's own bad input
RUN_ERRORS: tuple[type[Exception], ...] = (*USER_ERRORS, SwapError)
NAMES = {
    "step_s": "step time",
    "read_bytes": "bytes read",
    "write_bytes": "bytes written",
    "peak_rss": "peak RSS",
}


def swap_dirs(args: argparse.Namespace, swap_dir: Path) -> tuple[Path, ...]:
    """The directories the validation swaps to: the plan's --nvme-path, or the temporary one
    its recording used."""
    return tuple(args.nvme_path) or (swap_dir,)


def cannot_validate(
    args: argparse.Namespace, gpu: bool, scaled: bool, params: int, total_ram: int
) -> str | None:
    """Why this plan's best candidate cannot be run here (None: it can), naming what to change."""
    if args.ranks > 1:
        return (
            f"--validate runs the best candidate here, in one process: a plan for --ranks "
            f"{args.ranks} (ZeRO-3 across {args.ranks} GPUs) cannot run on this machine; "
            f"plan with --ranks 1 to validate"
        )
    if gpu:
        return (
            f"--validate measures the plan on this machine's compute: a plan for "
            f"--device-profile {args.device_profile} predicts another device, which is not "
            f"here; plan with --device-profile 'this machine' to validate"
        )
    if scaled:
        why = (
            "--scaled"
            if args.scaled
            else f"{params:,} parameters > --max-local-params {args.max_local_params:,.0f}"
        )
        return (
            f"--validate runs the model the plan is for, but this plan extrapolates from a "
            f"scaled-down copy ({why}): the full model is not trained here; drop --scaled or "
            f"raise --max-local-params to plan (and validate) the model itself"
        )
    dirs = max(1, len(args.nvme_path))
    if dirs not in args.drives:
        return (
            f"--validate runs on the plan's {dirs} swap director{'y' if dirs == 1 else 'ies'} "
            f"(--nvme-path, once per drive), and no table of --drives "
            f"{','.join(map(str, args.drives))} is for {dirs} drive(s): add {dirs} to --drives"
        )
    for flag, value in (("--host-ram", args.host_ram), ("--device-mem", args.device_mem)):
        if value is not None and value > total_ram:
            return (
                f"--validate runs the best candidate here, but {flag} {format_size(value)} is "
                f"more than this machine's {format_size(total_ram)}: a candidate sized for it "
                f"may not fit here; leave {flag} out (or lower it) to validate"
            )
    return None


def _table(plan: Plan, drives: int) -> Table:
    return next(t for t in plan.tables if t.drives == drives)


def validate(plan: Plan, args: argparse.Namespace, swap_dir: Path, steps: int) -> dict[str, Any]:
    """Runs the best candidate that fits (on the table of as many drives as swap directories)
    here, and compares it with its prediction: the mean of :data:`planner.ITERATIONS`
    replayed iterations after their first ones (the table's figures replay fewer)."""
    dirs = swap_dirs(args, swap_dir)
    table = _table(plan, len(dirs))
    fitting = [c for c in table.ranked if c.fits]
    if not fitting:
        raise UserError(
            "--validate: no candidate fits, so there is nothing to run: raise --host-ram or "
            "--device-mem, or widen the grid"
        )
    best = fitting[0]
    config = best.config if best.config.nvme_path else best.config.replace(nvme_path=dirs)
    assert plan.replay is not None  # run() sets it
    prediction = plan.replay(best.config, best.disk or table.disk, planner.ITERATIONS)
    spec = {
        "hf_config": str(args.hf_config) if args.hf_config is not None else None,
        "module": args.module,
        "args": args.args,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "optimizer": args.optimizer,
        "config": config.to_dict(),
        "warmup": WARMUP,
        "steps": steps,
        "threads": torch.get_num_threads(),
    }
    measured = spawn_child("infinity.cli.plan_validation", ["--spec", json.dumps(spec)], [])
    if "error" in measured:
        raise UserError(f"--validate: the run of the best candidate failed: {measured['error']}")
    compared = compare(prediction, measured, GOALS)
    modes = {"predicted": prediction["update_mode"], "measured": measured["update_mode"]}
    return {
        "drives": table.drives,
        "config": config.to_dict(),
        "warmup": WARMUP,
        "steps": steps,
        "predicted": {
            key: prediction[key]
            for key in (
                "step_seconds",
                "step_seconds_spread",
                "bytes_read",
                "bytes_written",
                "rss_peak_bytes",
                "peak_bytes",
                "bound",
                "update_mode",
                "update_mode_reasons",
            )
        }
        | {"iterations": prediction["iterations"]},
        "measured": measured,
        "compared": compared,
        "update_mode": modes,
        "verdict": verdict(compared, modes),
    }


def verdict(compared: dict[str, dict[str, Any]], modes: dict[str, str]) -> str:
    """One line: every figure within its goal, or which missed and by how much; and whether
    the updates ran where the prediction said."""
    missed = [
        f"{NAMES[key]} {c['ratio']:.2f}x (goal {c['goal']:.0%})"
        for key, c in compared.items()
        if not c["met"]
    ]
    same_mode = modes["predicted"] == modes["measured"]
    if not same_mode:
        missed.append(f"update mode (predicted {modes['predicted']}, ran {modes['measured']})")
    mode = f"updates {modes['measured']}, as predicted" if same_mode else ""
    if not missed:
        return (
            f"within {GOALS['step_s']:.0%} / {GOALS['read_bytes']:.0%} / "
            f"{GOALS['peak_rss']:.0%} (step time / bytes read and written / peak RSS); {mode}"
        )
    return "missed: " + ", ".join(missed) + (f"; {mode}" if mode else "")


def lines(validation: dict[str, Any]) -> list[str]:
    """The validation block printed after the table."""
    config = OffloadConfig.from_dict(validation["config"])
    predicted, measured, compared = (
        validation["predicted"],
        validation["measured"],
        validation["compared"],
    )
    buffers = (
        f", {config.buffer_count} x {size_text(config.buffer_size)} buffers"
        if "nvme" in (config.offload_param, config.offload_optimizer)
        else ""
    )
    low, high = predicted["step_seconds_spread"]
    averaged = predicted["iterations"]["averaged"]
    out = [
        "",
        f"validation: the best candidate ({config.offload_param}/{config.offload_optimizer} "
        f"{config.precision.dtype}, host budget {size_text(config.host_budget)}, device budget "
        f"{size_text(config.device_budget)}{buffers}) run here on "
        f"{', '.join(str(p) for p in config.nvme_path)}: {validation['warmup']} warm-up "
        f"step(s), then {validation['steps']} measured; predicted: the mean of {averaged} "
        f"replayed step(s) after {predicted['iterations']['replayed'] - averaged}",
    ]
    rows = [
        ("", "predicted", "measured", "ratio"),
        (
            "step s",
            f"{predicted['step_seconds']:.4g} ({low:.4g}-{high:.4g})",
            f"{measured['step_s']:.4g} (median)",
            f"{compared['step_s']['ratio']:.2f}",
        ),
    ]
    for key, label in (
        ("read_bytes", "read/step"),
        ("write_bytes", "write/step"),
        ("peak_rss", "peak RSS"),
    ):
        rows.append(
            (
                label,
                size_text(round(compared[key]["predicted"])),
                size_text(round(compared[key]["measured"])),
                f"{compared[key]['ratio']:.3f}",
            )
        )
    modes = validation["update_mode"]
    rows.append(
        (
            "updates",
            modes["predicted"],
            modes["measured"],
            "same" if modes["predicted"] == modes["measured"] else "differ",
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    out.append(f"verdict: {validation['verdict']}")
    return out


# ---------------------------------------------------------------------------- the run


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Builds the plan's model, attaches the candidate's configuration and trains
    ``spec['warmup']`` + ``spec['steps']`` steps with the recording's loop
    (``plan_models.record``): what :func:`infinity.cli.common.measure.measure_steps` measures."""
    torch.set_num_threads(spec["threads"])
    if spec["hf_config"] is not None:
        source = hf_source(Path(spec["hf_config"]))
    else:
        source = module_source(spec["module"], spec["args"])
    torch.manual_seed(0)
    model = source.make()
    optimizer = OPTIMIZERS[spec["optimizer"]](model.parameters())
    generator = torch.Generator().manual_seed(0)
    with TieredStore(OffloadConfig.from_dict(spec["config"])) as store:
        model, optimizer = store.attach(model, optimizer)

        def step() -> None:
            call_args, kwargs = inputs_for(source, model, spec["batch"], spec["seq_len"], generator)
            loss_of(model(*call_args, **kwargs)).backward()
            optimizer.step()
            optimizer.zero_grad()

        measured = measure_steps(store, step, spec["warmup"], spec["steps"])
        store.close(restore_params=False)
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plan_validation", description="infinity-plan --validate's run (one process)"
    )
    parser.add_argument("--spec", required=True, help="the run, as JSON (see validate())")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # as infinity-plan does, so that both processes hold the same libraries (the recording's
    # RSS besides the tiers is the prediction's base)
    quiet_transformers()
    try:
        result = measure(json.loads(args.spec))
    except RUN_ERRORS as exc:
        result = {"error": str(exc).splitlines()[0]}
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
