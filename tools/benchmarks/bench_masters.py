"""Masters benchmark: what bf16 masters (``precision.master_dtype='bf16'``) cost the training curve.

A small Llama (hidden 128, 4 layers, 4 heads, byte vocabulary: 0.9 M parameters) learns to
predict the next byte of this project's own documentation (README and docs/, real text, always
at hand), batch 8 x 64, AdamW (lr 3e-3 after 10 warm-up steps, weight decay 0.01), ``--steps``
steps (default 200), from the same initial weights and the same batches in every run:

* ``fp32 masters``: attached, ``dtype='bf16'``, masters in fp32 (the default);
* ``bf16 masters``: attached, ``dtype='bf16', master_dtype='bf16'``: the update in fp32,
  rounded back stochastically;
* each of the two with the Adam moments stored in int8 as well (``--state both``, the default:
  the 8 B fine-tune's configuration is bf16 masters with int8 state);
* ``bf16 as it is``: plain PyTorch, the model in bf16 and AdamW on it (round to nearest,
  no store): the curve that stochastic rounding is there to avoid.

Each run is attached with parameters and optimizer state on NVMe. For each it prints the mean
training loss of the last 20 steps and the loss on held-out text (the last tenth, never trained
on) after the last step; then each bf16-master run against the fp32-master run with the same
state dtype: the difference in held-out loss and in the last steps' loss, and the bytes each
stores per parameter (``stats()['disk']``).

    python -m tools.benchmarks.bench_masters [--steps 200] [--state fp32|int8|both] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
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


def batches(train: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` batches of BATCH windows of CONTEXT bytes, drawn from a generator of their own."""
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(0, train.numel() - CONTEXT, (steps, BATCH), generator=generator)
    return torch.stack([torch.stack([train[s : s + CONTEXT] for s in row]) for row in starts])


def held_out_windows(held: torch.Tensor) -> torch.Tensor:
    count = held.numel() // CONTEXT
    return held[: count * CONTEXT].view(count, CONTEXT)[:64]


def lr_at(step: int, base: float) -> float:
    return base * min(1.0, (step + 1) / 10)


def run(
    name: str, precision: dict[str, str] | None, data: torch.Tensor, held: torch.Tensor, swap: Path
) -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
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
        f"{name:32s} loss of the last {LAST} steps {result['last_loss']:.4f}, held-out "
        f"{held_loss:.4f}; {per_param}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--state", choices=("fp32", "int8", "both"), default="both")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = corpus()
    split = text.numel() * 9 // 10
    data, held = batches(text[:split], args.steps), text[split:]
    print(
        f"{text.numel()} bytes of text ({split} trained on), {args.steps} steps of "
        f"{BATCH} x {CONTEXT}",
        flush=True,
    )
    states = ["fp32", "int8"] if args.state == "both" else [args.state]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-masters-") as tmp:
        for state in states:
            for masters in ("fp32", "bf16"):
                precision = {
                    "dtype": "bf16",
                    "master_dtype": masters,
                    "optimizer_state_dtype": state,
                }
                name = f"{masters} masters, {state} state"
                results.append(run(name, precision, data, held, Path(tmp) / name.replace(" ", "")))
        results.append(run("bf16 as it is (no store)", None, data, held, Path(tmp) / "plain"))
    print()
    for state in states:
        base, rounded = (r for r in results if r["name"].endswith(f"{state} state"))
        held_diff = rounded["held_out_loss"] - base["held_out_loss"]
        last_diff = rounded["last_loss"] - base["last_loss"]
        print(
            f"{state} state: bf16 masters against fp32 masters: held-out loss {held_diff:+.4f} "
            f"({100 * held_diff / base['held_out_loss']:+.2f}%), last {LAST} steps "
            f"{last_diff:+.4f} ({100 * last_diff / base['last_loss']:+.2f}%); "
            f"{rounded['bytes_per_param']:.2f} against {base['bytes_per_param']:.2f} B/param "
            f"on disk"
        )
    plain = results[-1]
    best = min(r["held_out_loss"] for r in results if r["precision"])
    print(
        f"bf16 as it is (round to nearest): held-out loss {plain['held_out_loss']:.4f}, "
        f"{plain['held_out_loss'] - best:+.4f} against the best attached run"
    )
    finite = all(math.isfinite(r["held_out_loss"]) for r in results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
