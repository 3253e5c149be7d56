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
the swap engine slow each other here (``tools/benchmarks/contention.py``), which every prediction
of the family then replays (``--no-contention``: predicted as if they did not).

    python -m tools.benchmarks.plan_matrix [--families mlp-wide,gpt --params nvme --modes auto]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import infinity
from infinity.planning.planner import DiskProfile
from infinity.planning.simulated_time import Contention
from tools.benchmarks import contention
from tools.benchmarks.bench_overlap import engine_bandwidth, mlp
from tools.common.cli import spawn_child
from tools.common.measure import GOALS, compare, measure_steps, reset_peak
from tools.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

log = logging.getLogger("tools.benchmarks.plan_matrix")

GIB = 1 << 30
FAMILIES = ("mlp-wide", "mlp-deep", "gpt", "llama", "lora")
#: host budgets, as shares of the training state's bytes
BUDGETS = {"most": 0.9, "half": 0.5, "quarter": 0.25}
MODES: dict[str, bool | str] = {"auto": "auto", "step": False}
PARAMS = ("cpu", "nvme")
BUFFER_SIZE = 4 << 20

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
    probe = _config(args, 1 << 30)
    bandwidth = engine_bandwidth(args.nvme_path, args.disk_bytes, probe)
    disk = DiskProfile(bandwidth["read"] / 1e9, bandwidth["write"] / 1e9, shared=True)
    # The recording's base RSS is the process's peak less its tiers: the disk measurement's
    # buffers, freed by now, must not be in that peak (on a small model they were most of it).
    reset_peak()
    store, measured = _train(args, BUDGETS["most"])
    if store is None:
        return {"recorded": measured, "predictions": {}}
    state = measured["state_bytes"]
    predictions, uncontended = {}, {}
    measured_contention = Contention(**json.loads(args.contention)) if args.contention else None
    for name, share in BUDGETS.items():
        budget = int(share * state)
        predictions[name] = store.predict(
            disk=disk, contention=measured_contention, host_budget=budget
        )
        if measured_contention is not None:  # the same without it, to show what it changes
            uncontended[name] = store.predict(disk=disk, host_budget=budget).get("step_seconds")
    store.close(restore_params=False)
    return {
        "recorded": measured,
        "predictions": predictions,
        "uncontended_step_seconds": uncontended,
        "state_bytes": state,
    }


def child_run(args: argparse.Namespace) -> dict:
    store, measured = _train(args, BUDGETS[args.budget])
    if store is not None:
        store.close(restore_params=False)
    return measured


def _row(
    cell: str, prediction: dict, measured: dict, uncontended: float | None = None
) -> tuple[str, dict[str, float]]:
    if not prediction.get("fits", True) or not measured.get("fits", True):
        said = "fits" if prediction.get("fits", True) else "does not fit"
        ran = "ran" if measured.get("fits", True) else "did not attach"
        return f"{cell:32s} predicted: {said}; measured: {ran}", {}
    compared = compare(prediction, measured)
    ratios = {key: c["ratio"] for key, c in compared.items()}
    pairs = {key: (c["predicted"], c["measured"]) for key, c in compared.items()}
    step_p, step_m = pairs["step_s"]
    read_p, read_m = pairs["read_bytes"]
    write_p, write_m = pairs["write_bytes"]
    rss_p, rss_m = pairs["peak_rss"]
    line = (
        f"{cell:32s} {step_p:6.3f}/{step_m:6.3f} {ratios['step_s']:5.2f} | "
        f"{read_p / 1e6:7.1f}/{read_m / 1e6:7.1f} {ratios['read_bytes']:5.2f} | "
        f"{write_p / 1e6:7.1f}/{write_m / 1e6:7.1f} {ratios['write_bytes']:5.2f} | "
        f"{rss_p / GIB:5.2f}/{rss_m / GIB:5.2f} {ratios['peak_rss']:5.2f} "
        f"[{prediction.get('bound', '?')}]"
        + (f" step {uncontended / step_m:.2f} without contention" if uncontended else "")
    )
    return line, ratios


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plan_matrix", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--families", default=",".join(FAMILIES), help="comma list of %(default)s")
    add("--params", default=",".join(PARAMS), help="comma list of %(default)s")
    add("--modes", default=",".join(MODES), help="comma list of %(default)s")
    add("--steps", type=int, default=5, help="timed steps after the warm-up")
    add("--warmup", type=int, default=3)
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
    header = (
        f"{'family / params / mode / budget':32s} {'step s pred/meas':>19s} | "
        f"{'read MB pred/meas':>21s} | {'write MB pred/meas':>21s} | {'RSS GiB pred/meas':>17s}"
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
                    module = "tools.benchmarks.plan_matrix"
                    record = spawn_child(
                        module, common, ["--child=record", f"--contention={contention_json}"]
                    )
                    for budget in BUDGETS:
                        measured = spawn_child(
                            module, common, ["--child=run", f"--budget={budget}"]
                        )
                        cell = f"{family} / {params} / {mode} / {budget}"
                        prediction = record["predictions"].get(
                            budget,
                            {
                                "fits": False,
                                "error": "the recording did not attach: "
                                + record["recorded"].get("error", "?"),
                            },
                        )
                        line, ratios = _row(
                            cell,
                            prediction,
                            measured,
                            record.get("uncontended_step_seconds", {}).get(budget),
                        )
                        print(line, flush=True)
                        cells[cell] = {"predicted": prediction, "measured": measured}
                        if prediction.get("fits", True) != measured.get("fits", True):
                            wrong_fit.append(cell)
                        compared += bool(ratios)
                        for key, ratio in ratios.items():
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
    if args.json:
        args.json.write_text(json.dumps(cells, default=float, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
