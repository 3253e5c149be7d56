"""``make gpu-check``: the CUDA path on one GPU, within 8 minutes, with the machine's own torch,
no network and no liburing needed (the repository on PYTHONPATH). Each stage runs in a process
of its own under its own timeout, and the JSON is written after every stage, whatever happens
(a stage that hangs, crashes or times out is recorded as such and the next one runs):

1. ``tests``: the CUDA tests (``tests/test_cuda.py``, quantized weights decoded on the device).
2. ``race``: a model wide enough that the GPU lags the host (``torch.cuda._sleep`` in each
   module's forward pre-hook), under a device budget that evicts every step and a look-ahead,
   several steps against plain CUDA: the first step bit for bit (the same kernels on the same
   values), the later ones within rounding (the store's optimizer runs on the host).
3. ``activations``: activation offload with ``device='cuda'`` and ``device='cuda:0'``,
   asserting it offloaded.
4. ``profile``: one step of a GPT of about 0.4 B parameters under ``torch.profiler`` with CUDA
   activities: kernel time, host->device and device->host copy time and how much of it overlaps
   kernels, from the device's own timeline; synchronisations per step; device memory reserved
   against the budget; pinned bytes against the arena.
5. ``bench``: the short training benchmark (step time, tokens/s, bytes moved).

    PYTHONPATH=. python3 -m tools.benchmarks.gpu_check [--out gpu_check.json] [--nvme-path DIR]

Writes ``--out`` (default ``gpu_check.json``), and ``$OUT/gpu_check.json`` with the stages'
logs beside it when ``$OUT`` is set. Exits 2 without a GPU (the JSON says so), 1 when a stage
failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: each stage's timeout in seconds; together they fit the 8 minutes with the start
STAGES: dict[str, int] = {"tests": 150, "race": 60, "activations": 45, "profile": 120, "bench": 75}
TOTAL_SECONDS = 470


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--stage-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", choices=sorted(STAGES), default=None)
    args = parser.parse_args(argv)
    if args.stage:
        return run_stage(args)
    out = args.out / "gpu_check.json" if args.out.is_dir() else args.out
    figures: dict[str, Any] = {"python": platform.python_version(), "stages": {}}
    outputs = [out]
    if os.environ.get("OUT"):
        outputs.append(Path(os.environ["OUT"]) / "gpu_check.json")
    logs = Path(os.environ["OUT"]) if os.environ.get("OUT") else out.parent

    def write() -> None:
        for path in outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(figures, indent=2, default=str))

    def on_signal(signum: int, frame: Any) -> None:
        figures["interrupted"] = signal.Signals(signum).name
        write()
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_signal)
    reason = _no_gpu_reason(figures)
    if reason is not None:
        figures["gpu"] = False
        figures["reason"] = reason
        write()
        print(f"gpu-check: {reason}; run it on a GPU machine")
        return 2
    figures["gpu"] = True
    write()
    print(
        f"gpu-check on {figures['device']}, torch {figures['torch']} (CUDA {figures['cuda']}), "
        f"liburing {'yes' if figures['liburing'] else 'no (thread backend)'}"
    )
    deadline = time.monotonic() + TOTAL_SECONDS
    failed = False
    for name, limit in STAGES.items():
        if args.only is not None and name not in args.only:
            continue
        left = deadline - time.monotonic()
        if left < 10:
            figures["stages"][name] = {"skipped": "no time left of the 8 minutes"}
            write()
            continue
        result = _run_child(name, min(limit, int(left)), args, logs)
        figures["stages"][name] = result
        failed = failed or not result.get("ok", False)
        print(f"{name}: {_summary(result)}")
        write()
    print(f"figures written to {', '.join(str(p) for p in outputs)}")
    return 1 if failed else 0


def _no_gpu_reason(figures: dict[str, Any]) -> str | None:
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported here ({exc})"
    figures["torch"] = torch.__version__
    figures["cuda"] = torch.version.cuda
    if not torch.cuda.is_available():
        return (
            f"no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False)"
        )
    figures["device"] = torch.cuda.get_device_name(0)
    try:
        import liburing  # noqa: F401

        figures["liburing"] = True
    except ImportError:
        figures["liburing"] = False
    return None


def _run_child(name: str, limit: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Runs stage ``name`` in a process of its own under ``limit`` seconds; what it wrote to its
    JSON, with how it ended."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as scratch:
        stage_out = Path(scratch) / "stage.json"
        command = [
            sys.executable,
            "-m",
            "tools.benchmarks.gpu_check",
            "--stage",
            name,
            "--stage-out",
            str(stage_out),
        ]
        if args.nvme_path is not None:
            command += ["--nvme-path", str(args.nvme_path)]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        )
        started = time.monotonic()
        result: dict[str, Any] = {"timeout_s": limit}
        try:
            done = subprocess.run(
                command, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit
            )
            output = done.stdout + done.stderr
            result["returncode"] = done.returncode
        except subprocess.TimeoutExpired as exc:
            output = _text(exc.stdout) + _text(exc.stderr)
            result["timed_out"] = True
        result["seconds"] = round(time.monotonic() - started, 1)
        if stage_out.exists():
            try:
                result.update(json.loads(stage_out.read_text()))
            except ValueError as exc:
                result["error"] = f"unreadable stage JSON: {exc}"
        result["ok"] = bool(result.get("ok")) and result.get("returncode") == 0
        try:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"gpu_check_{name}.log").write_text(output)
        except OSError:
            pass
        if not result["ok"]:
            result["output_tail"] = output[-3000:]
        return result


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _summary(result: dict[str, Any]) -> str:
    if result.get("timed_out"):
        return f"timed out after {result['timeout_s']} s"
    keys = ("summary", "verdict", "error")
    said = "; ".join(str(result[k]) for k in keys if k in result)
    return f"{'ok' if result.get('ok') else 'FAILED'} in {result.get('seconds')} s {said}"


# -- the stages (each in its own process) ---------------------------------------------------------
def run_stage(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"ok": False}
    assert args.stage_out is not None
    stages: dict[str, Callable[[argparse.Namespace, dict[str, Any]], None]] = {
        "tests": stage_tests,
        "race": stage_race,
        "activations": stage_activations,
        "profile": stage_profile,
        "bench": stage_bench,
    }
    try:
        stages[args.stage](args, result)
    except BaseException as exc:
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        args.stage_out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


def stage_tests(args: argparse.Namespace, result: dict[str, Any]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "tests/test_cuda.py",
            "tests/test_quantized_weights.py::"
            "test_cuda_moves_the_stored_bytes_and_decodes_on_the_device",
        ],
        capture_output=True,
        text=True,
        timeout=STAGES["tests"] - 10,
        cwd=REPO,
    )
    print(done.stdout[-6000:], done.stderr[-3000:])
    result["summary"] = (done.stdout.strip().splitlines() or ["no output"])[-1]
    result["ok"] = done.returncode == 0


def _sleep_hooks(model: Any, cycles: int) -> None:
    """Keeps the GPU behind the host: each module's forward first spins the compute stream."""
    import torch

    def spin(module: Any, inputs: Any) -> None:
        torch.cuda._sleep(cycles)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(spin)


def stage_race(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import copy

    import torch

    import infinity

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    width, layers, steps = 4096, 6, 4
    torch.manual_seed(0)
    layers_list: list[torch.nn.Module] = []
    for _ in range(layers):
        layers_list += [torch.nn.Linear(width, width), torch.nn.GELU()]
    reference = torch.nn.Sequential(*layers_list)
    batches = [torch.randn(256, width) for _ in range(steps)]

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for batch in batches:
            loss = model(batch.to("cuda")).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().float().cpu())
        return losses

    plain = copy.deepcopy(reference).to("cuda")
    _sleep_hooks(plain, 20_000_000)
    want = run(plain, torch.optim.SGD(plain.parameters(), lr=1e-3))
    per_layer = width * width * 4 + width * 4
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            device="cuda",
            offload_param="cpu",
            offload_optimizer="cpu",
            device_budget=3 * per_layer,
            prefetch_depth=2,
            step_in_backward=False,
        )
    )
    model = copy.deepcopy(reference)
    _sleep_hooks(model, 20_000_000)
    model, optimizer = store.attach(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    got = run(model, optimizer)
    stats = store.stats()
    assert store.placement is not None  # attached
    ahead = store.placement.copies.gathered_ahead
    store.close(restore_params=False)
    differences = [float((a - b).abs() / b.abs().clamp_min(1e-12)) for a, b in zip(got, want)]
    result.update(
        losses=[float(x) for x in got],
        plain_losses=[float(x) for x in want],
        first_step_bit_for_bit=bool(torch.equal(got[0], want[0])),
        max_relative_difference=max(differences),
        gathered_ahead=ahead,
        bytes_to_device=stats.get("bytes_to_device"),
    )
    result["ok"] = result["first_step_bit_for_bit"] and max(differences) < 1e-4
    result["verdict"] = (
        f"first step {'bit for bit' if result['first_step_bit_for_bit'] else 'DIFFERS'}, "
        f"max relative difference {max(differences):.2e} over {steps} steps"
    )


def stage_activations(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import torch

    import infinity
    from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    config = GPTConfig(vocab_size=256, context=128, layers=4, width=256, heads=4)
    offloaded = {}
    for name in ("cuda", "cuda:0"):
        torch.manual_seed(0)
        model = TinyGPT(config)
        store = infinity.TieredStore(
            infinity.OffloadConfig(device=name, offload_param="cpu", offload_activations="cpu")
        )
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
        tokens, targets = (t.to(store.device) for t in next(synthetic_batches(config, 8)))
        model(tokens, targets).backward()
        optimizer.step()
        activations = store.stats()["activations"] or {}
        offloaded[name] = {
            "device": str(store.device),
            "offloaded_tensors": activations.get("offloaded_tensors", 0),
            "offloaded_bytes": activations.get("offloaded_bytes", 0),
        }
        store.close(restore_params=False)
    result["offloaded"] = offloaded
    result["ok"] = all(v["offloaded_tensors"] > 0 for v in offloaded.values())
    result["verdict"] = ", ".join(
        f"{k}: {v['offloaded_tensors']} tensors" for k, v in offloaded.items()
    )


def timeline_figures(events: Iterable[dict[str, Any]], steps: int = 1) -> dict[str, Any]:
    """From a chrome trace's events (torch.profiler with CUDA activities): kernel seconds,
    host->device and device->host copy seconds and the part of each that ran while a kernel
    ran (on the device's own clock), and synchronisations per step (the host waiting for the
    device: stream, event and device synchronize calls)."""
    from infinity.core.timeline import intersect, length, union

    kernels: list[tuple[float, float]] = []
    copies: dict[str, list[tuple[float, float]]] = {"h2d": [], "d2h": []}
    syncs = 0
    for event in events:
        if event.get("ph") != "X":
            continue
        category = str(event.get("cat", "")).lower()
        name = str(event.get("name", ""))
        start = float(event.get("ts", 0.0))
        span = (start, start + float(event.get("dur", 0.0)))
        if category == "kernel":
            kernels.append(span)
        elif category == "gpu_memcpy":
            if "HtoD" in name:
                copies["h2d"].append(span)
            elif "DtoH" in name:
                copies["d2h"].append(span)
        elif category in ("cuda_runtime", "cuda_driver") and "Synchronize" in name:
            syncs += 1
    busy = union(kernels)
    figures: dict[str, Any] = {
        "kernel_s": length(busy) / 1e6,
        "synchronizations_per_step": syncs / max(steps, 1),
    }
    for direction, spans in copies.items():
        merged = union(spans)
        total = length(merged)
        overlapped = length(intersect(merged, busy))
        figures[f"{direction}_s"] = total / 1e6
        figures[f"{direction}_overlapped_s"] = overlapped / 1e6
        figures[f"{direction}_overlap_fraction"] = overlapped / total if total else None
    return figures


def _locked_bytes() -> dict[str, int]:
    """The process's locked and pinned memory as the kernel counts it (VmLck, VmPin)."""
    figures = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmLck", "VmPin"):
                figures[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return figures


def _gpt_store(root: Path, layers: int, width: int, context: int) -> tuple[Any, Any, Any, Any]:
    import torch

    import infinity
    from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT

    gpt = GPTConfig(
        vocab_size=32000, context=context, layers=layers, width=width, heads=width // 128
    )
    swap = root / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    config = infinity.OffloadConfig(
        device="cuda",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(swap,),
        buffer_size=64 << 20,
        buffer_count=16,
        host_budget=16 << 30,
        device_budget=1 << 30,
        prefetch_depth=2,
        precision=infinity.PrecisionConfig(dtype="bf16"),
    )
    with torch.device("meta"):
        model = TinyGPT(gpt)
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return gpt, store, model, optimizer


def _step(model: Any, optimizer: Any, tokens: Any, targets: Any) -> float:
    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def stage_profile(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from infinity.cli.common.tiny_gpt import GPTConfig, parameter_count, synthetic_batches

    root = Path(tempfile.mkdtemp(prefix="gpu-check-profile-", dir=args.nvme_path))
    try:
        gpt, store, model, optimizer = _gpt_store(root, layers=16, width=1280, context=512)
        result["params"] = parameter_count(gpt)
        data = synthetic_batches(GPTConfig(vocab_size=256, context=gpt.context), 4)
        tokens, targets = (t.to("cuda") for t in next(data))
        _step(model, optimizer, tokens, targets)  # warm: the trace, the arena, the kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trace = root / "trace.json"
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _step(model, optimizer, tokens, targets)
            torch.cuda.synchronize()
        result["step_s"] = time.perf_counter() - started
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
        result["timeline"] = timeline_figures(events)
        stats = store.stats()
        plan = store.memory_plan
        result["reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["device_budget"] = plan.device if plan is not None else None
        result["device_tier_peak"] = stats["peak_bytes"]["device"]
        result["reserved_excess"] = store.placement.device.check_reserved()
        result["pinned_bytes"] = stats["pinned_bytes"]
        result["arena_bytes"] = plan.arena if plan is not None else None
        result["locked"] = _locked_bytes()
        store.close(restore_params=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    line = result["timeline"]
    result["ok"] = line["kernel_s"] > 0
    result["verdict"] = (
        f"kernels {line['kernel_s']:.3f} s, h2d {line['h2d_s']:.3f} s "
        f"({line['h2d_overlap_fraction'] or 0:.0%} under kernels), d2h {line['d2h_s']:.3f} s "
        f"({line['d2h_overlap_fraction'] or 0:.0%}), {line['synchronizations_per_step']:.0f} "
        f"syncs; reserved {result['reserved_bytes'] / 2**30:.2f} GiB (budget "
        f"{(result['device_budget'] or 0) / 2**30:.2f}); pinned "
        f"{result['pinned_bytes'] / 2**30:.2f} of the arena's "
        f"{(result['arena_bytes'] or 0) / 2**30:.2f} GiB"
    )


def stage_bench(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import torch

    from infinity.cli.common.tiny_gpt import GPTConfig, parameter_count, synthetic_batches

    root = Path(tempfile.mkdtemp(prefix="gpu-check-bench-", dir=args.nvme_path))
    try:
        gpt, store, model, optimizer = _gpt_store(root, layers=20, width=1536, context=1024)
        result["params"] = parameter_count(gpt)
        data = synthetic_batches(GPTConfig(vocab_size=256, context=gpt.context), 4)
        times, before = [], store.stats()
        for step in range(3):
            tokens, targets = (t.to("cuda") for t in next(data))
            if step == 2:
                before = store.stats()
            torch.cuda.synchronize()
            started = time.perf_counter()
            loss = _step(model, optimizer, tokens, targets)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            print(f"step {step + 1}: {times[-1]:.2f} s, loss {loss:.3f}", flush=True)
        after = store.stats()
        store.close(restore_params=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    step_s = times[-1]
    result.update(
        step_s=times,
        tokens_per_s=4 * gpt.context / step_s,
        h2d_GBps=(after["bytes_to_device"] - before["bytes_to_device"]) / step_s / 1e9,
        nvme_read_GBps=(after["bytes_read"] - before["bytes_read"]) / step_s / 1e9,
        nvme_written_GBps=(after["bytes_written"] - before["bytes_written"]) / step_s / 1e9,
        device_peak=after["peak_bytes"]["device"],
    )
    result["ok"] = True
    result["verdict"] = f"step {step_s:.2f} s, {result['tokens_per_s']:.0f} tokens/s"


if __name__ == "__main__":
    raise SystemExit(main())
