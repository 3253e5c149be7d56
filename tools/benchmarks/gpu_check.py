"""``make gpu-check``: the CUDA path on a GPU machine, in one prepared run of a few minutes that
needs no network (the repository on PYTHONPATH; torch from the machine; ``liburing`` if it is
there, else the thread backend, said once).

1. The CUDA tests (``tests/test_cuda.py``, and quantized weights decoded on the device).
2. The host<->device link: pinned copies of 1 GiB each way, the best of three.
3. The disk: the swap engine's write and read bandwidth on ``--nvme-path``.
4. A training benchmark: a GPT-style model of about 1.3 B parameters in bf16, parameters and
   optimizer state on NVMe, under a device budget well below the model: step time, tokens/s,
   host<->device GB/s against the link's, NVMe GB/s against the engine's, overlap efficiency
   (max(compute, I/O) / step, from the timeline of the last step), the device tier's peak
   against its budget.

Writes ``gpu_check.json`` and ``timeline.png`` to ``--out`` (default ``$OUT``, else
``gpu-check-out``). Exits 2 without a GPU, 1 when the tests fail.

    PYTHONPATH=. python3 -m tools.benchmarks.gpu_check [--nvme-path DIR] [--params 1.3B] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device-budget", type=float, default=1.0, help="GiB")
    parser.add_argument("--host-budget", type=float, default=24.0, help="GiB")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(
            f"gpu-check: torch cannot be imported here ({exc}); run it where PyTorch with CUDA "
            f"is installed"
        )
        return 2
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device here (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); run it on a GPU machine"
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    figures: dict = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "python": platform.python_version(),
    }
    try:
        import liburing  # noqa: F401

        figures["liburing"] = True
    except ImportError:
        figures["liburing"] = False
        print(
            "gpu-check: the liburing package is not installed: the swap engine uses its "
            "thread backend"
        )
    print(f"gpu-check on {figures['device']}, torch {figures['torch']} (CUDA {figures['cuda']})")
    status = 0
    if not args.skip_tests:
        status = run_tests(figures, args.out)
    root = Path(tempfile.mkdtemp(prefix="infinity-gpu-check-", dir=args.nvme_path))
    try:
        figures["link"] = link_bandwidth(torch)
        print(
            f"link: host->device {figures['link']['h2d'] / 1e9:.1f} GB/s, device->host "
            f"{figures['link']['d2h'] / 1e9:.1f} GB/s (pinned, 1 GiB)"
        )
        figures["train"] = train(args, root, figures)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2))
    print(f"figures written to {args.out / 'gpu_check.json'}")
    return status


def run_tests(figures: dict, out: Path) -> int:
    started = time.perf_counter()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"),
            "tests/test_quantized_weights.py::"
            "test_cuda_moves_the_stored_bytes_and_decodes_on_the_device",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    (out / "cuda_tests.log").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    figures["tests"] = {
        "returncode": done.returncode,
        "summary": summary,
        "seconds": time.perf_counter() - started,
    }
    print(f"CUDA tests: {summary}")
    if done.returncode:
        print(done.stdout[-4000:])
    return 1 if done.returncode else 0


def link_bandwidth(torch) -> dict:
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, (dst, src) in (("h2d", (device, host)), ("d2h", (host, device))):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        result[name] = nbytes / best
    return result


def train(args: argparse.Namespace, root: Path, figures: dict) -> dict:
    import torch

    import infinity
    from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, parameter_count, synthetic_batches
    from infinity.cli.common.transfers import engine_bandwidth

    gpt = GPTConfig(
        vocab_size=32000,
        context=args.context,
        layers=args.layers,
        width=args.width,
        heads=args.width // 128,
    )
    params = parameter_count(gpt)
    swap = root / "swap"
    swap.mkdir()
    config = infinity.OffloadConfig(
        device="cuda",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(swap,),
        buffer_size=64 << 20,
        buffer_count=16,
        host_budget=int(args.host_budget * 2**30),
        device_budget=int(args.device_budget * 2**30),
        precision=infinity.PrecisionConfig(dtype="bf16"),
    )
    disk = engine_bandwidth(swap, 4 << 30, config)
    figures["disk"] = disk
    print(
        f"disk: write {disk['write'] / 1e9:.2f} GB/s, read {disk['read'] / 1e9:.2f} GB/s "
        f"(swap engine on {swap})"
    )
    print(
        f"model: GPT {args.layers} x {args.width}, {params / 1e9:.2f} B params, bf16; "
        f"device budget {args.device_budget:.1f} GiB (model {params * 2 / 2**30:.1f} GiB in "
        f"bf16), host budget {args.host_budget:.0f} GiB"
    )
    with torch.device("meta"):
        model = TinyGPT(gpt)
    store = infinity.TieredStore(config)
    started = time.perf_counter()
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    attach_s = time.perf_counter() - started
    data = synthetic_batches(GPTConfig(vocab_size=256, context=args.context), args.batch)
    times = []
    before = store.stats()
    for step in range(args.steps):
        if step == args.steps - 1:
            store.timeline.clear()
            store.timeline.enabled = True
            before = store.stats()
        tokens, targets = (t.to("cuda") for t in next(data))
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        print(f"step {step + 1}: {times[-1]:.2f} s, loss {loss.item():.3f}")
    after = store.stats()
    summary = store.timeline.summary()
    store.timeline.plot(Path(args.out) / "timeline.png", title="gpu-check, last step")
    store.close(restore_params=False)
    step_s = times[-1]
    h2d = (after["bytes_to_device"] - before["bytes_to_device"]) / step_s
    read = after["bytes_read"] - before["bytes_read"]
    written = after["bytes_written"] - before["bytes_written"]
    result = {
        "params": params,
        "attach_s": attach_s,
        "step_s": times,
        "tokens_per_s": args.batch * args.context / step_s,
        "h2d_GBps": h2d / 1e9,
        "h2d_vs_link": h2d / figures["link"]["h2d"],
        "nvme_read_GBps": read / step_s / 1e9,
        "nvme_written_GBps": written / step_s / 1e9,
        "nvme_vs_engine": (read + written) / step_s / (disk["read"] + disk["write"]) * 2,
        "overlap_efficiency": max(summary["compute_seconds"], summary["io_busy_seconds"]) / step_s,
        "timeline": {k: v for k, v in summary.items() if k != "counts"},
        "device_peak": after["peak_bytes"]["device"],
        "device_budget": config.device_budget,
    }
    print(
        f"step {step_s:.2f} s, {result['tokens_per_s']:.0f} tokens/s; host->device "
        f"{result['h2d_GBps']:.1f} GB/s ({result['h2d_vs_link']:.2f}x the link); NVMe read "
        f"{result['nvme_read_GBps']:.2f} + write {result['nvme_written_GBps']:.2f} GB/s; "
        f"overlap efficiency {result['overlap_efficiency']:.2f}; device tier peak "
        f"{result['device_peak'] / 2**30:.2f} of {(config.device_budget or 0) / 2**30:.2f} GiB"
    )
    return result


if __name__ == "__main__":
    raise SystemExit(main())
