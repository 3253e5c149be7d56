"""The planner's validation matrix: model families x host budgets x update modes x where the
parameters live, each cell predicted from one recording and then run.

For each model family (two MLP shapes, the demo GPT, a Hugging Face Llama, a LoRA model whose
base is frozen), each place for the parameters (``cpu``, ``nvme``; AdamW state on NVMe) and
each update mode (``auto``: in backward from the second step; ``step``: in
``optimizer.step()``), one process records a run at a host budget that holds nearly all of the
training state and predicts the step at that budget, at half and at a quarter of it; then each
budget runs in a process of its own (its peak RSS its own). Printed per cell: predicted against
measured step time (goal: within 15%), bytes read and written per step (within 5%) and peak RSS
(within 10%), then the worst cell of each.

Before a family's cells, a process of its own measures how the family's plain training step and
the swap engine slow each other here (``infinity/cli/common/contention.py``), which every prediction
of the family then replays (``--no-contention``: predicted as if they did not).

This machine's speed drifts by more than the step-time goal over minutes, so each place and mode
is done in ``--passes`` interleaved passes (default 3; the budgets' order reversed in every other
one), each a recording and a run per budget. A cell is judged on the median over the passes of
predicted over measured within one pass: a recording and the runs it predicts are minutes apart at
most, and one pass on a slow or fast stretch of the machine does not decide the cell.

    python -m tools.benchmarks.plan_matrix [--families mlp-wide,gpt --params nvme --modes auto]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.cli.common import contention
from infinity.cli.common.args import spawn_child
from infinity.cli.common.measure import GOALS, compare, measure_steps, reset_peak
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from infinity.cli.common.transfers import store_disk_profile
from infinity.planning import planner
from infinity.planning.simulated_time import Contention
from tools.common.workloads import mlp

log = logging.getLogger("tools.benchmarks.plan_matrix")

GIB = 1 << 30
FAMILIES = ("mlp-wide", "mlp-deep", "gpt", "llama", "lora")
#: host budgets, as shares of the training state's bytes
BUDGETS = {"most": 0.9, "half": 0.5, "quarter": 0.25}
MODES: dict[str, bool | str] = {"auto": "auto", "step": False}
PARAMS = ("cpu", "nvme")
BUFFER_SIZE = 4 << 20
#: parts of the model each budget is also predicted without, and what the summary calls them
ALTERNATIVES = {
    "contention": "without contention",
    "mixed directions": "without the disk's slower pace with reads and writes mixed",
}

Step = Callable[[], torch.Tensor]


def _llama(lora: bool) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
    )
    model: nn.Module = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"], lora_alpha=32)
        )
    return model


def build(family: str) -> tuple[nn.Module, Callable[[nn.Module], Step]]:
    """The family's model, and a maker of its loss for one batch (fresh batches each call)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if family in ("mlp-wide", "mlp-deep"):
        layers, width, batch = (16, 1536, 16) if family == "mlp-wide" else (48, 512, 64)
        model: nn.Module = mlp(layers, width)

        def mlp_loss(m: nn.Module) -> Step:
            return lambda: m(torch.randn(batch, width, generator=generator)).square().mean()

        return model, mlp_loss
    if family == "gpt":
        config = GPTConfig(vocab_size=2048, context=128, layers=8, width=512, heads=8)
        data = synthetic_batches(config, 8, seed=1)

        def gpt_loss(m: nn.Module) -> Step:
            def loss() -> torch.Tensor:
                tokens, targets = next(data)
                return m(tokens, targets)

            return loss

        return TinyGPT(config), gpt_loss
    model = _llama(lora=family == "lora")

    def llama_loss(m: nn.Module) -> Step:
        def loss() -> torch.Tensor:
            ids = torch.randint(0, 4096, (4, 128), generator=generator)
            return m(input_ids=ids, labels=ids).loss

        return loss

    return model, llama_loss


def state_bytes(model: nn.Module) -> int:
    """Training state with AdamW: every parameter's fp32 values, and for the trained ones a
    gradient and two moments."""
    every = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 4 * every + 12 * trained


def _config(args: argparse.Namespace, host_budget: int) -> infinity.OffloadConfig:
    return infinity.OffloadConfig(
        device="cpu",
        offload_param=args.params,
        offload_optimizer="nvme",
        nvme_path=(Path(args.nvme_path),),
        buffer_size=BUFFER_SIZE,
        host_budget=host_budget,
        step_in_backward=MODES[args.mode],
    )


def _train(args: argparse.Namespace, share: float) -> tuple[infinity.TieredStore | None, dict]:
    model, make_loss = build(args.family)
    state = state_bytes(model)
    budget = int(share * state)
    store = infinity.TieredStore(_config(args, budget))
    try:
        model, optimizer = store.attach(
            model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        )
    except infinity.BudgetError as exc:
        store.close(restore_params=False)
        return None, {"fits": False, "error": str(exc)}
    loss = make_loss(model)

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad()

    measured = measure_steps(store, step, args.warmup, args.steps)
    return store, {"fits": True, "state_bytes": state, "host_budget": budget, **measured}


def child_contention(args: argparse.Namespace) -> dict:
    """How the family's plain training step (in memory, no store) and the swap engine slow each
    other here: what the planner's replay takes as this machine's contention."""
    model, make_loss = build(args.family)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loss = make_loss(model)

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad()

    return contention.measure_for_planner(
        args.nvme_path, _config(args, 1 << 30), step, f"a plain {args.family} step", args.disk_bytes
    ).as_dict()


def child_record(args: argparse.Namespace) -> dict:
    # The disk first, with the engine's settings alone (no model is built twice: a first one's
    # freed heap would count against the budget at attach)
    disk = store_disk_profile(args.nvme_path, args.disk_bytes, _config(args, 1 << 30))
    # The recording's base RSS is the process's peak less its tiers: the disk measurement's
    # buffers, freed by now, must not be in that peak (on a small model they were most of it).
    reset_peak()
    store, measured = _train(args, BUDGETS["most"])
    if store is None:
        return {"recorded": measured, "predictions": {}}
    state = measured["state_bytes"]
    predictions: dict[str, dict] = {}
    # each budget's step predicted without one of the model's parts, to show what it changes
    without: dict[str, dict[str, Any]] = {part: {} for part in ALTERNATIVES}
    measured_contention = Contention(**json.loads(args.contention)) if args.contention else None
    unmixed = dataclasses.replace(disk, combined_gbps=None)
    for name, share in BUDGETS.items():
        budget = int(share * state)
        predictions[name] = store.predict(
            disk=disk, contention=measured_contention, host_budget=budget
        )
        if measured_contention is not None:
            without["contention"][name] = store.predict(disk=disk, host_budget=budget).get(
                "step_seconds"
            )
        if disk.mixed_efficiency < 1.0:
            without["mixed directions"][name] = store.predict(
                disk=unmixed, contention=measured_contention, host_budget=budget
            ).get("step_seconds")
    store.close(restore_params=False)
    return {
        "recorded": measured,
        "predictions": predictions,
        "without": without,
        "disk": dataclasses.asdict(disk),
        "mixed_efficiency": disk.mixed_efficiency,
        "state_bytes": state,
    }


def child_run(args: argparse.Namespace) -> dict:
    store, measured = _train(args, BUDGETS[args.budget])
    if store is not None:
        store.close(restore_params=False)
    return measured


def judge(passes: list[tuple[dict, dict]]) -> dict[str, Any]:
    """One cell over its passes, each a (prediction, measurement) pair taken minutes apart.
    ``agreed``: whether every pass ran as its prediction said (``predicted_fits`` and ``ran``
    per pass); ``ratios``: for each goal the median over the passes of predicted/measured (none
    unless every pass predicted a fit and ran); ``predicted``/``measured``: each figure's median
    over the passes; ``step_spread``: the slowest measured step over the fastest; ``bound``: the
    resource the predictions named most often."""
    if not passes:
        raise ValueError("a cell needs at least one pass")
    predicted_fit = [prediction.get("fits", True) for prediction, _ in passes]
    ran = [measured.get("fits", True) for _, measured in passes]
    agreed = predicted_fit == ran
    out: dict[str, Any] = {
        "agreed": agreed,
        "predicted_fits": predicted_fit,
        "ran": ran,
        "ratios": {},
        "predicted": {},
        "measured": {},
        "step_spread": None,
        "bound": None,
    }
    if not (all(predicted_fit) and all(ran)):
        return out
    compared = [compare(prediction, measured) for prediction, measured in passes]
    for key in compared[0]:
        out["ratios"][key] = statistics.median(c[key]["ratio"] for c in compared)
        out["predicted"][key] = statistics.median(c[key]["predicted"] for c in compared)
        out["measured"][key] = statistics.median(c[key]["measured"] for c in compared)
    bounds = [str(prediction.get("bound", "?")) for prediction, _ in passes]
    out["bound"] = max(set(bounds), key=bounds.count)
    steps = [c["step_s"]["measured"] for c in compared]
    out["step_spread"] = max(steps) / min(steps) if min(steps) > 0 else float("inf")
    return out


def _row(cell: str, judged: dict[str, Any], uncontended: list[float]) -> str:
    """The cell's line; ``uncontended``: each pass's step predicted without contention over its
    measured step."""
    if not judged["ratios"]:
        said = "fits" if all(judged["predicted_fits"]) else "does not fit"
        ran = "ran" if all(judged["ran"]) else "did not attach"
        if not judged["agreed"]:
            said = "fits in passes " + _passes(judged["predicted_fits"])
            ran = "ran in passes " + _passes(judged["ran"])
        return f"{cell:32s} predicted: {said}; measured: {ran}"
    ratios, predicted, measured = judged["ratios"], judged["predicted"], judged["measured"]
    line = (
        f"{cell:32s} {predicted['step_s']:6.3f}/{measured['step_s']:6.3f} "
        f"{ratios['step_s']:5.2f} x{judged['step_spread']:4.2f} | "
        f"{predicted['read_bytes'] / 1e6:7.1f}/{measured['read_bytes'] / 1e6:7.1f} "
        f"{ratios['read_bytes']:5.2f} | "
        f"{predicted['write_bytes'] / 1e6:7.1f}/{measured['write_bytes'] / 1e6:7.1f} "
        f"{ratios['write_bytes']:5.2f} | "
        f"{predicted['peak_rss'] / GIB:5.2f}/{measured['peak_rss'] / GIB:5.2f} "
        f"{ratios['peak_rss']:5.2f} [{judged['bound']}]"
    )
    if uncontended:
        line += f" step {statistics.median(uncontended):.2f} without contention"
    return line


def _passes(flags: list[bool]) -> str:
    return ",".join(str(i + 1) for i, flag in enumerate(flags) if flag) or "none"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plan_matrix", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--families", default=",".join(FAMILIES), help="comma list of %(default)s")
    add("--params", default=",".join(PARAMS), help="comma list of %(default)s")
    add("--modes", default=",".join(MODES), help="comma list of %(default)s")
    # The window a prediction averages: where a host tier still settles over the first steps
    # (the 16 x 1536 MLP on cpu at 90% read 84 MB in the replay's fourth step and 69 in its
    # twelfth), a shorter run's mean is of other steps (81 MB measured over five, 75 predicted).
    add(
        "--steps",
        type=int,
        default=planner.ITERATIONS - planner.WARMUP,
        help="timed steps after the warm-up (default: as many as a prediction averages)",
    )
    add(
        "--passes",
        type=int,
        default=3,
        help="interleaved passes per place and mode, each a recording and a run per budget",
    )
    add("--warmup", type=int, default=planner.WARMUP)
    add("--disk-bytes", type=int, default=256 << 20, help="bytes of the disk measurement")
    add("--nvme-path", type=Path, default=None)
    add("--json", type=Path, default=None)
    add(
        "--no-contention",
        action="store_true",
        help="predict as if compute and the disk did not slow each other (not measured)",
    )
    add("--child", choices=("contention", "record", "run"), help=argparse.SUPPRESS)
    add("--contention", help=argparse.SUPPRESS)
    add("--family", help=argparse.SUPPRESS)
    add("--mode", help=argparse.SUPPRESS)
    add("--budget", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.passes < 1:
        raise SystemExit(f"--passes must be at least 1, got {args.passes}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.child:
        if isinstance(args.params, str) and "," in args.params:
            raise SystemExit("--child needs one --params")
        children = {"contention": child_contention, "record": child_record, "run": child_run}
        result = children[args.child](args)
        print(json.dumps(result, default=float))
        return 0
    own_dir = args.nvme_path is None
    root = args.nvme_path or Path(tempfile.mkdtemp(prefix="plan-matrix-"))
    cells: dict[str, dict[str, Any]] = {}
    worst: dict[str, tuple[float, str]] = {key: (0.0, "") for key in GOALS}
    missed: dict[str, list[str]] = {key: [] for key in GOALS}
    compared = 0
    wrong_fit: list[str] = []  # the prediction said it fits and it did not, or the reverse
    alternative_ratios: dict[str, dict[str, float]] = {part: {} for part in ALTERNATIVES}
    efficiencies: list[float] = []  # the disk's pace with both directions, per recording
    header = (
        f"{'family / params / mode / budget':32s} {'step s pred/meas ratio spread':>29s} | "
        f"{'read MB pred/meas':>21s} | {'write MB pred/meas':>21s} | {'RSS GiB pred/meas':>17s}"
    )
    print(
        f"medians over {args.passes} interleaved passes; ratio: predicted/measured within a "
        f"pass; spread: the slowest measured step over the fastest",
        flush=True,
    )
    print(header, flush=True)
    try:
        for family in args.families.split(","):
            contention_json = ""
            if not args.no_contention:
                found = spawn_child(
                    "tools.benchmarks.plan_matrix",
                    [f"--family={family}", "--params=nvme", "--mode=auto", f"--nvme-path={root}"],
                    ["--child=contention", f"--disk-bytes={args.disk_bytes}"],
                )
                contention_json = json.dumps(found)
                print(f"contention ({family}): {found['source']}", flush=True)
            for params in args.params.split(","):
                for mode in args.modes.split(","):
                    common = [
                        f"--family={family}",
                        f"--params={params}",
                        f"--mode={mode}",
                        f"--nvme-path={root}",
                        f"--steps={args.steps}",
                        f"--warmup={args.warmup}",
                        f"--disk-bytes={args.disk_bytes}",
                    ]
                    runs: dict[str, list[tuple[dict, dict]]] = {b: [] for b in BUDGETS}
                    without: dict[str, dict[str, list[float]]] = {p: {} for p in ALTERNATIVES}
                    for number in range(args.passes):
                        _one_pass(
                            args, common, contention_json, number, runs, without, efficiencies
                        )
                    for budget in BUDGETS:
                        cell = f"{family} / {params} / {mode} / {budget}"
                        judged = judge(runs[budget])
                        contention_off = without["contention"].get(budget, [])
                        print(_row(cell, judged, contention_off), flush=True)
                        cells[cell] = {
                            "judged": judged,
                            "passes": [
                                {"predicted": prediction, "measured": measured}
                                for prediction, measured in runs[budget]
                            ],
                            "without": {p: without[p].get(budget, []) for p in ALTERNATIVES},
                        }
                        if not judged["agreed"]:
                            wrong_fit.append(cell)
                        compared += bool(judged["ratios"])
                        for part in ALTERNATIVES:
                            ratios = without[part].get(budget)
                            if judged["ratios"] and ratios:
                                alternative_ratios[part][cell] = statistics.median(ratios)
                        for key, ratio in judged["ratios"].items():
                            off = abs(ratio - 1)
                            if off > worst[key][0]:
                                worst[key] = (off, cell)
                            if off > GOALS[key]:
                                missed[key].append(cell)
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    names = {
        "step_s": "step time",
        "read_bytes": "bytes read",
        "write_bytes": "bytes written",
        "peak_rss": "peak RSS",
    }
    print()
    agreed = len(cells) - len(wrong_fit)
    print(
        f"fits or not: the prediction agreed with the run in {agreed} of {len(cells)} cells"
        + (f"; not in: {', '.join(wrong_fit)}" if wrong_fit else "")
    )
    for key, name in names.items():
        off, cell = worst[key]
        print(
            f"{name} within {GOALS[key]:.0%}: {compared - len(missed[key])} of {compared} "
            f"cells; worst {off:.1%} off ({cell or '-'})"
            + (f"; missed: {', '.join(missed[key])}" if missed[key] else "")
        )
    if efficiencies:
        print(
            f"the disk's pace with reads and writes mixed, as measured before each recording: "
            f"{min(efficiencies):.0%}-{max(efficiencies):.0%} of what the two directions alone "
            f"imply (median {statistics.median(efficiencies):.0%})"
        )
    for part, label in ALTERNATIVES.items():
        by_cell = alternative_ratios[part]
        if by_cell:
            within = sum(abs(r - 1) <= GOALS["step_s"] for r in by_cell.values())
            print(
                f"step time within {GOALS['step_s']:.0%} if predicted {label}: {within} of "
                f"{len(by_cell)} cells"
            )
    if args.json:
        args.json.write_text(json.dumps(cells, default=float, indent=1))
    return 0


def _one_pass(
    args: argparse.Namespace,
    common: list[str],
    contention_json: str,
    number: int,
    runs: dict[str, list[tuple[dict, dict]]],
    without: dict[str, dict[str, list[float]]],
    efficiencies: list[float],
) -> None:
    """One recording and a run per budget (in reverse order on odd passes), appended to
    ``runs`` as (prediction, measurement) pairs; ``without[part][budget]`` gains the step
    predicted without that part of the model over the run's, and ``efficiencies`` the disk's
    measured pace with reads and writes mixed."""
    module = "tools.benchmarks.plan_matrix"
    record = spawn_child(module, common, ["--child=record", f"--contention={contention_json}"])
    if "mixed_efficiency" in record:
        efficiencies.append(record["mixed_efficiency"])
    order = list(BUDGETS) if number % 2 == 0 else list(reversed(BUDGETS))
    for budget in order:
        measured = spawn_child(module, common, ["--child=run", f"--budget={budget}"])
        prediction = record["predictions"].get(
            budget,
            {
                "fits": False,
                "error": "the recording did not attach: " + record["recorded"].get("error", "?"),
            },
        )
        runs[budget].append((prediction, measured))
        for part, steps in record.get("without", {}).items():
            step = steps.get(budget)
            if step and measured.get("fits", True) and measured.get("step_s"):
                without[part].setdefault(budget, []).append(step / measured["step_s"])


if __name__ == "__main__":
    raise SystemExit(main())
