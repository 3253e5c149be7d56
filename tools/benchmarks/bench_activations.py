"""Activation benchmark: a small GPT with a long sequence, where saved activations are most of
the memory, side by side: activations kept on the device, activation checkpointing (each block),
offload to host memory and offload to NVMe (``offload_activations``).

Each configuration runs in a process of its own (peak RSS is per process), parameters in host
memory (``offload_param='cpu'``) in every one. It prints the median step, the device tier's peak
(parameters + saved activations, sampled together), the saved activations' own peak, the
activation bytes written to and read from the disk, and the peak RSS.

Saved-activation bytes are counted the same way everywhere: storages autograd holds for
backward, on the device, from when they are saved until they are copied out (offload) or
released (after their node ran in backward).

    python -m tools.benchmarks.bench_activations [--layers 4 --width 256 --context 1024 --batch 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

import torch

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, parameter_count, synthetic_batches
from infinity.core.memory import peak_resident_bytes

CONFIGS = ("keep", "checkpoint", "offload cpu", "offload nvme")


class SavedBytes:
    """Saved activations held on the device, for the configurations without offload: a
    pass-through saved_tensors_hooks that counts each storage (not a parameter) from its first
    save until autograd lets go of every save of it."""

    def __init__(self, store: infinity.TieredStore) -> None:
        self.store = store
        self.current = self.peak = self.peak_total = 0
        self.lock = threading.Lock()
        self.live: dict[int, list] = {}

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        with self.lock:
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [0, storage.nbytes()]
                self.current += entry[1]
                self.peak = max(self.peak, self.current)
                self.peak_total = max(self.peak_total, self.current + self._params())
            entry[0] += 1
        holder = _Holder(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    def _params(self) -> int:
        placement = self.store.placement
        return placement.device.usage.current if placement is not None else 0

    def _release(self, key: int) -> None:
        with self.lock:
            entry = self.live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self.live[key]

    @staticmethod
    def unpack(holder: Any) -> torch.Tensor:
        return holder.tensor if isinstance(holder, _Holder) else holder


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def worker(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    gpt = GPTConfig(
        vocab_size=args.vocab,
        context=args.context,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        checkpoint_blocks=args.config == "checkpoint",
    )
    model = TinyGPT(gpt)
    target = args.config.split()[-1] if args.config.startswith("offload") else "none"
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as swap:
        store = infinity.TieredStore(
            infinity.OffloadConfig(
                device="cpu",
                offload_param="cpu",
                offload_activations=target,
                nvme_path=swap,
                buffer_size=args.buffer_size,
            )
        )
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        counter = SavedBytes(store)
        data = synthetic_batches(gpt, args.batch, seed=1)
        times = []
        for _ in range(args.warmup + args.steps):
            tokens, targets = next(data)
            started = time.perf_counter()
            if target == "none":
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    loss = model(tokens, targets)
            else:
                loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - started)
        stats = store.stats()
        store.close()
    activations = stats["activations"]
    if activations is None:
        saved, total, written, read = counter.peak, counter.peak_total, 0, 0
    else:
        saved, total = activations["peak_device_bytes"], activations["peak_device_total_bytes"]
        written, read = activations["bytes_written"], activations["bytes_read"]
    steps = args.warmup + args.steps
    return {
        "config": args.config,
        "step_s": statistics.median(times[args.warmup :]),
        "loss": float(loss),
        "peak_device": total,
        "peak_saved": saved,
        "written_per_step": written / steps,
        "read_per_step": read / steps,
        "rss_peak": peak_resident_bytes(),
        "params": parameter_count(gpt),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--buffer-size", type=int, default=16 << 20)
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)  # a worker
    args = parser.parse_args(argv)
    if args.config is not None:
        print(json.dumps(worker(args)))
        return 0
    results = []
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    for config in CONFIGS:
        command = [
            sys.executable,
            "-m",
            "tools.benchmarks.bench_activations",
            *passed,
            "--config",
            config,
        ]
        if args.json:
            command = [c for c in command if c != args.json]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    keep = results[0]
    print(
        f"GPT {keep['params'] / 1e6:.1f}M params, {args.layers} layers x width {args.width}, "
        f"context {args.context}, batch {args.batch}; parameters in host memory; "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        f"{'config':<14} {'step s':>7} {'x keep':>7} {'device peak MiB':>16} "
        f"{'saved peak MiB':>15} {'disk w/r MiB/step':>18} {'RSS peak MiB':>13}"
    )
    for r in results:
        print(
            f"{r['config']:<14} {r['step_s']:>7.3f} {r['step_s'] / keep['step_s']:>7.2f} "
            f"{r['peak_device'] / 2**20:>16.1f} {r['peak_saved'] / 2**20:>15.1f} "
            f"{r['written_per_step'] / 2**20:>8.0f}/{r['read_per_step'] / 2**20:<9.0f} "
            f"{r['rss_peak'] / 2**20:>13.0f}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
