"""Masters benchmark: what bf16 masters (``precision.master_dtype='bf16'``) cost the training curve.

A small Llama (hidden 128, 4 layers, 4 heads, byte vocabulary: 0.9 M parameters) learns to
predict the next byte of this project's own documentation (README and docs/, real text, always
at hand), batch 8 x 64, AdamW (lr 3e-3 after 10 warm-up steps, weight decay 0.01), ``--steps``
steps (default 200), from the same initial weights and the same batches in every configuration,
over ``--seeds`` (default 3) initial weights and orders of batches:

* ``fp32 masters``: attached, ``dtype='bf16'``, masters in fp32 (the default);
* ``bf16 masters``: attached, ``dtype='bf16', master_dtype='bf16'``: the update in fp32,
  rounded back stochastically;
* each of the two with the Adam moments stored in int8 as well (``--state both``, the default:
  the 8 B fine-tune's configuration is bf16 masters with int8 state);
* ``bf16 as it is``: plain PyTorch, the model in bf16 and AdamW on it (round to nearest,
  no store): the curve that stochastic rounding is there to avoid.

Each run is attached with parameters and optimizer state on NVMe. For each it prints the mean
training loss of the last 20 steps and the loss on held-out text (the last tenth, never trained
on) after the last step; then per configuration the mean over the seeds and their range, and
each bf16-master configuration against the fp32-master one with the same state dtype: the
difference of the mean held-out losses beside the fp32 masters' own spread over the seeds, and
the bytes each stores per parameter (``stats()['disk']``).

    python -m tools.benchmarks.bench_masters [--steps 200] [--state fp32|int8|both] [--seeds 3]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

import infinity

ROOT = Path(__file__).resolve().parents[2]
BATCH, CONTEXT, LAST = 8, 64, 20


def corpus() -> torch.Tensor:
    """The bytes of the README and docs/*.md, in a fixed order."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    data = b"\n".join(f.read_bytes() for f in files if f.is_file())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def model_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=CONTEXT,
    )


def batches(train: torch.Tensor, steps: int, seed: int) -> torch.Tensor:
    """``steps`` batches of BATCH windows of CONTEXT bytes, drawn from a generator of their own."""
    generator = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, train.numel() - CONTEXT, (steps, BATCH), generator=generator)
    return torch.stack([torch.stack([train[s : s + CONTEXT] for s in row]) for row in starts])


def held_out_windows(held: torch.Tensor) -> torch.Tensor:
    count = held.numel() // CONTEXT
    return held[: count * CONTEXT].view(count, CONTEXT)[:64]


def lr_at(step: int, base: float) -> float:
    return base * min(1.0, (step + 1) / 10)


def run(
    name: str,
    precision: dict[str, str] | None,
    data: torch.Tensor,
    held: torch.Tensor,
    swap: Path,
    seed: int,
) -> dict[str, Any]:
    import transformers

    torch.manual_seed(seed)
    model: torch.nn.Module = transformers.LlamaForCausalLM(model_config())
    store = None
    if precision is None:
        model = model.to(dtype=torch.bfloat16)
    optimizer: torch.optim.Optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if precision is not None:
        swap.mkdir(parents=True)
        store = infinity.TieredStore(
            infinity.OffloadConfig().replace(
                device="cpu",
                offload_param="nvme",
                offload_optimizer="nvme",
                nvme_path=(swap,),
                buffer_size=256 << 10,
                precision=precision,
            )
        )
        model, optimizer = store.attach(model, optimizer)
    losses = []
    try:
        for step, tokens in enumerate(data):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, 3e-3)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            windows = held_out_windows(held)
            held_loss = model(input_ids=windows, labels=windows).loss.item()
        disk = store.stats()["disk"]["needs"] if store is not None else None
        params = sum(p.numel() for p in model.parameters())
    finally:
        if store is not None:
            store.close(restore_params=False)
    result = {
        "name": name,
        "seed": seed,
        "precision": precision,
        "losses": losses,
        "last_loss": sum(losses[-LAST:]) / len(losses[-LAST:]),
        "held_out_loss": held_loss,
        "bytes_per_param": disk["total"] / params if disk is not None else None,
    }
    per_param = (
        f"{result['bytes_per_param']:.2f} B/param on disk"
        if result["bytes_per_param"] is not None
        else "in memory"
    )
    print(
        f"{name:32s} seed {seed}: loss of the last {LAST} steps {result['last_loss']:.4f}, "
        f"held-out {held_loss:.4f}; {per_param}",
        flush=True,
    )
    return result


def summary(results: list[dict[str, Any]], name: str, key: str) -> tuple[float, float, float]:
    """(mean, min, max) of ``key`` over the seeds of configuration ``name``."""
    values = [r[key] for r in results if r["name"] == name]
    return statistics.fmean(values), min(values), max(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--state", choices=("fp32", "int8", "both"), default="both")
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="runs of each configuration, each with its own initial weights and batches: the "
        "spread between them is the noise a difference must stand out of",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    text = corpus()
    split = text.numel() * 9 // 10
    held = text[split:]
    print(
        f"{text.numel()} bytes of text ({split} trained on), {args.steps} steps of "
        f"{BATCH} x {CONTEXT}, {args.seeds} seed(s)",
        flush=True,
    )
    states = ["fp32", "int8"] if args.state == "both" else [args.state]
    configs: list[tuple[str, dict[str, str] | None]] = [
        (
            f"{masters} masters, {state} state",
            {"dtype": "bf16", "master_dtype": masters, "optimizer_state_dtype": state},
        )
        for state in states
        for masters in ("fp32", "bf16")
    ]
    configs.append(("bf16 as it is (no store)", None))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-masters-") as tmp:
        for seed in range(args.seeds):
            data = batches(text[:split], args.steps, seed)
            for name, precision in configs:
                swap = Path(tmp) / f"{name.replace(' ', '')}-{seed}"
                results.append(run(name, precision, data, held, swap, seed))
    print()
    for name, _ in configs:
        mean, low, high = summary(results, name, "held_out_loss")
        last = summary(results, name, "last_loss")[0]
        print(
            f"{name:32s} held-out loss {mean:.4f} (seeds {low:.4f}-{high:.4f}), last {LAST} "
            f"steps {last:.4f}"
        )
    for state in states:
        base, rounded = f"fp32 masters, {state} state", f"bf16 masters, {state} state"
        held_diff = (
            summary(results, rounded, "held_out_loss")[0]
            - summary(results, base, "held_out_loss")[0]
        )
        _, low, high = summary(results, base, "held_out_loss")
        per_param = [
            next(r["bytes_per_param"] for r in results if r["name"] == n) for n in (rounded, base)
        ]
        print(
            f"{state} state: bf16 masters against fp32 masters: held-out loss {held_diff:+.4f} "
            f"on the mean (fp32 masters' own spread over the seeds: {high - low:.4f}); "
            f"{per_param[0]:.2f} against {per_param[1]:.2f} B/param on disk"
        )
    finite = all(math.isfinite(r["held_out_loss"]) for r in results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
