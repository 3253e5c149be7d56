"""Quality of quantized weights: the demo GPT trained, then evaluated with its weights stored as
fp32, bf16, int8 and int4 by the store, against the same model in RAM.

The demo GPT (``infinity.cli.common.tiny_gpt``) is trained in plain PyTorch (AdamW) for
``--steps`` on the demo's synthetic text, so its weights carry structure that rounding can
damage; the loss before and after training is printed. Then, on held-out batches of text in
the same language (rule) drawn with another seed:
  * ram: the trained model in memory, fp32 (the reference);
  * ours-<storage>: a copy of the trained model attached for inference (no optimizer,
    ``offload_param="nvme"`` in a temporary directory, host and device budgets below the
    weights' bytes, so every forward streams them) with ``precision.storage_dtype`` fp32
    (auto), bf16, int8 and int4 (groups of 128, and of 32 where the widths allow), quantized
    at attach from the trained values.
For each it prints the stored weight bytes, the held-out loss (cross-entropy over every held-out
position), its difference relative to ram (goals: int8 within 0.5%, int4 within 3%), the share
of positions whose top-1 next token is ram's, and the largest |logit difference|.

    python -m tools.benchmarks.quant_quality [--steps 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from infinity.cli.generate import offload_config
from infinity.config import format_size, parse_size

#: the demo's synthetic text uses the first 64 token ids (see infinity.cli.demo)
TEXT_VOCAB = 64
#: relative held-out loss difference against fp32 in RAM the issue asks for
GOALS = {"int8": 0.005, "int4": 0.03}
TRAIN_SEED = 0
HELD_OUT_SEED = 1234


@dataclass(frozen=True)
class Storage:
    """One way the store keeps the weights: ``precision.storage_dtype`` and int4's group."""

    dtype: str
    group: int = 128

    @property
    def name(self) -> str:
        if self.dtype == "int4":
            return f"ours-int4/g{self.group}"
        return f"ours-{self.dtype}"

    @property
    def goal(self) -> float | None:
        return GOALS.get(self.dtype)


def text_config(gpt: GPTConfig) -> GPTConfig:
    return GPTConfig(vocab_size=min(TEXT_VOCAB, gpt.vocab_size), context=gpt.context)


def held_out_batches(gpt: GPTConfig, count: int, batch: int) -> list[tuple[torch.Tensor, ...]]:
    """Text the model never saw, in the language (rule) it was trained on."""
    text = synthetic_batches(text_config(gpt), batch, seed=HELD_OUT_SEED, rule_seed=TRAIN_SEED)
    return [next(text) for _ in range(count)]


def mean_loss(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, ...]]) -> float:
    _, loss = logits_and_loss(model, batches)
    return loss


def logits_and_loss(
    model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, float]:
    """Every held-out position's logits, and the cross-entropy over all of them."""
    with torch.no_grad():
        logits = torch.cat([model(tokens) for tokens, _ in batches]).float()
    targets = torch.cat([targets for _, targets in batches])
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1)).item()
    return logits, loss


def train(
    gpt: GPTConfig, steps: int, batch: int, lr: float, held_out: Sequence[tuple[torch.Tensor, ...]]
) -> tuple[TinyGPT, dict[str, float]]:
    """The demo GPT trained in plain PyTorch; its held-out loss before and after."""
    torch.manual_seed(TRAIN_SEED)
    model = TinyGPT(gpt)
    untrained = mean_loss(model.eval(), held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    text = synthetic_batches(text_config(gpt), batch, seed=TRAIN_SEED)
    model.train()
    started = time.perf_counter()
    last = float("nan")
    for _ in range(steps):
        tokens, targets = next(text)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item()
    seconds = time.perf_counter() - started
    model.eval()
    return model, {
        "untrained_loss": untrained,
        "last_train_loss": last,
        "trained_loss": mean_loss(model, held_out),
        "train_seconds": seconds,
    }


def evaluate(
    trained: TinyGPT,
    storages: Sequence[Storage],
    held_out: Sequence[tuple[torch.Tensor, ...]],
    root: Path,
    host_budget: int,
    device_budget: int,
) -> dict[str, Any]:
    """ram (the trained model in memory) and each storage's attached copy on the held-out
    batches: loss, its difference relative to ram, top-1 agreement with ram, max |logit diff|,
    stored weight bytes and bytes read from the swap files per forward."""
    reference, ram_loss = logits_and_loss(trained, held_out)
    given = sum(p.numel() * p.element_size() for p in trained.parameters())
    rows: dict[str, Any] = {
        "ram": {"stored_bytes": given, "loss": ram_loss, "relative": 0.0, "top1": 1.0}
    }
    for storage in storages:
        nvme = root / storage.name.replace("/", "-")
        nvme.mkdir()
        model = copy.deepcopy(trained)  # attach takes the copy's weights; ram keeps its own
        config = offload_config(
            nvme, host_budget, device_budget, device="cpu", weights=storage.dtype,
            group_size=storage.group,
        )  # fmt: skip
        store = infinity.TieredStore(config)
        try:
            store.attach(model)
            before = store.stats()["bytes_read"]
            logits, loss = logits_and_loss(model, held_out)
            stats = store.stats()
        finally:
            store.close(restore_params=False)  # the copy's weights are not needed back
        rows[storage.name] = {
            "stored_bytes": stats["weights"]["stored_bytes"],
            "bytes_read_per_forward": (stats["bytes_read"] - before) // len(held_out),
            "loss": loss,
            "relative": (loss - ram_loss) / ram_loss,
            "top1": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "max_abs_diff": (logits - reference).abs().max().item(),
            "equal": torch.equal(logits, reference),
            "goal": storage.goal,
        }
        shutil.rmtree(nvme, ignore_errors=True)
    return rows


def storages_for(gpt: GPTConfig, groups: Sequence[int]) -> list[Storage]:
    """fp32, bf16, int8, then int4 in each group that divides every weight's input dimension
    (the width, and the MLP's 4 x width)."""
    int4 = [Storage("int4", g) for g in groups if g % 2 == 0 and gpt.width % g == 0]
    return [Storage("auto"), Storage("bf16"), Storage("int8"), *int4]


def verdict(row: dict[str, Any]) -> str:
    goal = row.get("goal")
    if goal is None:
        return ""
    met = abs(row["relative"]) <= goal
    return f"{'MET' if met else 'NOT MET'} (<= {goal:.1%})"


def summarize(results: dict[str, Any]) -> list[str]:
    training = results["training"]
    lines = [
        f"demo GPT {results['model']}; trained {results['steps']} steps in "
        f"{training['train_seconds']:.0f} s; held-out loss untrained "
        f"{training['untrained_loss']:.4f} -> trained {training['trained_loss']:.4f} "
        f"(last training batch {training['last_train_loss']:.4f})",
        f"held out: {results['held_out']}; ours: host budget "
        f"{format_size(results['host_budget'])}, device budget "
        f"{format_size(results['device_budget'])}",
        "",
        f"{'storage':<16}{'weights':>10}{'read/fwd':>11}{'loss':>9}{'vs ram':>10}"
        f"{'top-1 agree':>13}{'max|dlogit|':>13}  goal",
    ]
    for name, row in results["rows"].items():
        read = format_size(row["bytes_read_per_forward"]) if "goal" in row else "-"
        diff = f"{row['max_abs_diff']:.2e}" if "max_abs_diff" in row else "-"
        lines.append(
            f"{name:<16}{format_size(row['stored_bytes']):>10}{read:>11}{row['loss']:>9.4f}"
            f"{row['relative']:>+10.3%}{row['top1']:>13.2%}{diff:>13}  {verdict(row)}"
        )
    fp32 = results["rows"].get("ours-auto")
    if fp32 is not None:
        lines.append(
            "ours-auto (fp32 stored) "
            + (
                "gives exactly the in-RAM logits (torch.equal)"
                if fp32["equal"]
                else f"DIFFERS from the in-RAM logits (max {fp32['max_abs_diff']:.2e})"
            )
        )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="quant_quality",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (%(default)s)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (%(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (%(default)s)")
    p.add_argument("--layers", type=int, default=4, help="(%(default)s)")
    p.add_argument("--width", type=int, default=256, help="a multiple of 4 (%(default)s)")
    p.add_argument("--vocab", type=int, default=512, help="(%(default)s)")
    p.add_argument("--context", type=int, default=64, help="(%(default)s)")
    p.add_argument("--held-out", type=int, default=8, help="held-out batches (%(default)s)")
    p.add_argument(
        "--groups", default="128,32", help="int4 group sizes, where they divide (%(default)s)"
    )
    p.add_argument("--host-budget", default="1MiB", help="ours (%(default)s)")
    p.add_argument("--device-budget", default="2MiB", help="ours (%(default)s)")
    p.add_argument("--dir", type=Path, help="where the swap files go (default: $TMPDIR)")
    p.add_argument("--json", type=Path, help="write the table to this JSON file")
    args = p.parse_args(argv)
    try:
        args.host_budget = parse_size(args.host_budget, name="--host-budget")
        args.device_budget = parse_size(args.device_budget, name="--device-budget")
        args.groups = [int(g) for g in args.groups.split(",") if g.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if min(args.steps, args.batch, args.held_out, args.layers, args.vocab) < 1:
        p.error("--steps, --batch, --held-out, --layers and --vocab must be >= 1")
    if args.width < 4 or args.width % 4 or args.context < 2:
        p.error("--width must be a positive multiple of 4 (heads) and --context at least 2")
    return args


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    gpt = GPTConfig(
        vocab_size=args.vocab,
        context=args.context,
        layers=args.layers,
        width=args.width,
        heads=4,
    )
    held_out = held_out_batches(gpt, args.held_out, args.batch)
    trained, training = train(gpt, args.steps, args.batch, args.lr, held_out)
    rows = evaluate(
        trained, storages_for(gpt, args.groups), held_out, root, args.host_budget,
        args.device_budget,
    )  # fmt: skip
    count = sum(p.numel() for p in trained.parameters())
    return {
        "model": f"{count / 1e6:.2f} M params (width {gpt.width}, {gpt.layers} layers, vocab "
        f"{gpt.vocab_size}, context {gpt.context})",
        "steps": args.steps,
        "held_out": f"{args.held_out} x {args.batch} x {gpt.context} tokens, seed {HELD_OUT_SEED}",
        "host_budget": args.host_budget,
        "device_budget": args.device_budget,
        "training": training,
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="infinity-quant-quality-", dir=args.dir))
    try:
        results = run(args, root)
    except (RuntimeError, ValueError) as exc:
        print(f"quant_quality: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(summarize(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
