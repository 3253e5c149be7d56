"""infinity-plan: which offload configuration to run a model with, before paying for the run.

    infinity-plan --hf-config ./llama/config.json --batch 4 --seq-len 1024 --disk bench.json
    infinity-plan --module infinity.cli.common.tiny_gpt:TinyGPT \\
                  --args '{"layers": 12, "width": 768}' --batch 8 --seq-len 256 \\
                  --disk-gbps 2.5,1.8 \\
                  --write-config best.json
    infinity-plan --hf-config llama-2-70b.json --batch 1 --seq-len 4096 --device-profile H200 \\
                  --disk-gbps 7,7 --drives 4 --ranks 8 --host-ram 2TiB

It trains the model for a few steps here with its parameters and optimizer state on NVMe (recording
which module needs which parameters when, and how long each computes), then replays that recording
through the store's own placement, eviction, prefetch and step code for each candidate configuration
(``infinity.planning.planner.simulate``: tensors that hold no bytes, simulated disk and link time)
and prints the candidates best first: predicted step time, tokens/s, bytes read and written per
step, peak bytes per tier, peak RSS and the resource that bounds the step. Candidates that do not
fit (a budget below one module, more memory than --host-ram or
--device-mem) are listed with the reason. --write-config writes the best as a config file that
``OffloadConfig.from_file`` loads as it is.

A model with more parameters than --max-local-params (or with --scaled) is not trained here:
a scaled-down copy is (its layer stacks cut to --scaled-layers layers, and its widths halved
until it fits), and the full model's recording is extrapolated from it
(``infinity.planning.scaled.recording_for_scaled``): the copy's per-layer events repeated for
every layer of the full model, built on the meta device, each event's compute scaled by the
module's matmul FLOPs ratio. The CPU optimizer's time per element is then measured on large tensors.

With --validate [STEPS] the best candidate that fits is then run here for real (the same model,
batch, optimizer and loop, the candidate's configuration, the recording's swap directory), and
its prediction is printed against what it measured: step time, bytes read and written per step
and peak RSS, each with its ratio, and a verdict (infinity/cli/plan_validation.py). Only a plan
that can run here can be validated: not one for --ranks > 1, a GPU --device-profile or a
scaled-down copy.

With --disk measure the disk is measured here, on the swap directory, in each candidate's own
requests (its buffer_size, buffer_count of them in flight): each direction alone and both at
once. A drive's best point (infinity-bench) can be well above what a store's buffers get from it:
4 MiB reads, four or five in flight, moved 20% fewer GB/s than 64 MiB ones on the disk this was
built on.

With --ranks N (data-parallel GPUs under ZeRO-3) each rank is simulated holding, moving and
updating 1/N of the state while computing the whole model on its own batch; --drives are shared
by the ranks unless --own-drives gives each rank that many.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from infinity import OffloadConfig
from infinity.cli import plan_validation
from infinity.cli.common.args import USER_ERRORS as COMMON_USER_ERRORS
from infinity.cli.common.args import UserError, guarded, parse
from infinity.cli.common.transfers import store_disk_profile
from infinity.cli.plan_args import build_parser, given_contention
from infinity.cli.plan_models import (
    MIN_BUFFER,
    hf_source,
    measure_contention,
    measure_update_seconds,
    module_source,
    parameter_count,
    quiet_transformers,
    record,
    scaled_changes,
)
from infinity.cli.plan_report import Candidate, Plan, Table, candidate_json, table
from infinity.config import ALIGNMENT, format_size
from infinity.planning import planner
from infinity.planning import scaled as planner_scaled
from infinity.planning.planner import DeviceProfile, DiskProfile, PlanError, Recording
from infinity.planning.simulated_time import Contention

log = logging.getLogger("infinity.cli.plan")

#: device memory of the GPU presets (data sheets: A100 SXM4 80 GB, H100 SXM5 80 GB, H200 SXM
#: 141 GB of HBM)
DEVICE_MEMORY = {"A100": 80 * 10**9, "H100": 80 * 10**9, "H200": 141 * 10**9}
#: a simulated store's cost grows with its shard count: buffers (and so shards) at least this
#: fraction of a rank's masters keep a candidate's replay to seconds on a 70B model
MAX_SHARDS = 2048
MAX_BUFFER = 1 << 30


#: What a user fixes by changing flags or paths: one line, exit code 2, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (*COMMON_USER_ERRORS, PlanError)


# ---------------------------------------------------------------------------- arguments

#: stands for the profile --disk measure will measure, when the arguments are checked
_PLACEHOLDER = DiskProfile(1.0, 1.0, source="--disk measure")


def _align(nbytes: float) -> int:
    return max(ALIGNMENT, int(nbytes) // ALIGNMENT * ALIGNMENT)


def _pow2_at_least(nbytes: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(nbytes, 1))))


def candidates(
    skeleton: nn.Module,
    gpu: bool,
    host_ram: int,
    device_mem: int,
    ranks: int,
    base_rss: int,
    args: argparse.Namespace,
) -> list[OffloadConfig]:
    """A grid over where parameters and optimizer state live, the precision, the host budget
    (and with it the staging arena: buffer_count x buffer_size), the buffer size and the
    device budget, each bounded by what a rank may use of --host-ram and --device-mem."""
    numel = sum(p.numel() for p in skeleton.parameters())
    masters = 4 * numel
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in skeleton.modules())
    host = max(MIN_BUFFER * 4, host_ram // ranks - base_rss)
    precisions = args.precision or (["bf16"] if gpu else ["fp32"])
    base_buffer = min(MAX_BUFFER, max(MIN_BUFFER, _pow2_at_least(masters / MAX_SHARDS)))
    out: list[OffloadConfig] = []
    seen: set[str] = set()
    for param in args.offload_param:
        for optim in args.offload_optimizer:
            resident = masters if param == "cpu" or (param == "none" and optim == "cpu") else 0
            nvme = "nvme" in (param, optim)
            # What caching every offloaded byte in the arena would take: more buys nothing.
            cache_all = (
                masters if param == "nvme" or (param == "none" and optim == "nvme") else 0
            ) + (3 * masters if optim == "nvme" else 0)
            budgets = (
                sorted({_align(min(cache_all + base_buffer, host * f)) for f in (0.125, 0.5, 0.9)})
                if nvme
                else [None]
            )
            if args.host_budget and nvme:
                budgets = list(args.host_budget)
            for dtype in precisions:
                item = 2 if dtype in ("bf16", "fp16") else 4
                device_total = item * numel
                if param == "none":
                    devices: list[int | None] = [None]
                else:
                    # The tier on a GPU shares it with activations; here it is host memory.
                    share = (0.25, 0.6) if gpu else (0.125, 0.5)
                    devices = sorted(  # type: ignore[assignment]  # ints are int | None
                        {
                            _align(max(2 * item * largest, min(device_total, device_mem * f)))
                            for f in share
                        }
                    )
                    if args.device_budget:
                        devices = list(args.device_budget)
                for host_budget in budgets:
                    arena = (host_budget - resident) if host_budget is not None else 0
                    sizes = (
                        sorted(
                            {
                                min(base_buffer * k, _pow2_floor(max(MIN_BUFFER, arena // 4)))
                                for k in (1, 4)
                            }
                        )
                        if nvme
                        else [base_buffer]
                    )
                    if args.buffer_size:
                        sizes = list(args.buffer_size)
                    for size in sizes:
                        for device_budget in devices:
                            changes: dict[str, Any] = dict(
                                device="cuda" if gpu else "cpu",
                                offload_param=param,
                                offload_optimizer=optim,
                                buffer_size=size,
                                buffer_count=max(2, arena // size) if nvme else 5,
                                host_budget=(host_budget if nvme else max(resident, MIN_BUFFER)),
                                device_budget=device_budget,
                                precision={"dtype": dtype},
                                nvme_path=tuple(args.nvme_path),
                            )
                            config = OffloadConfig().replace(**changes)
                            key = json.dumps(config.to_dict(), sort_keys=True)
                            if key not in seen:
                                seen.add(key)
                                out.append(config)
    return out


def _pow2_floor(nbytes: int) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(nbytes, 1)))))


def evaluate(
    candidate: Candidate,
    skeleton_of: Callable[[], nn.Module],
    recording: Recording,
    disk: DiskProfile,
    device: DeviceProfile,
    gpu: bool,
    host_ram: int,
    device_mem: int,
    ranks: int,
    contention: Contention | None = None,
) -> None:
    """Simulates one candidate and judges it against the caps."""
    config = candidate.config.replace(device="cpu")  # the simulation runs anywhere
    result = planner.simulate(
        skeleton_of(),
        recording,
        config,
        disk,
        device,
        iterations=2,
        cpu_memory=not gpu,
        contention=contention,
    )
    candidate.result = result
    if not result["fits"]:
        candidate.reason = result.get("error", "does not fit")
        return
    peaks = result["peak_bytes"]
    if ranks * result["rss_peak_bytes"] > host_ram:
        candidate.reason = (
            f"peak RSS {format_size(result['rss_peak_bytes'])}"
            f"{f' x {ranks} ranks' if ranks > 1 else ''} > --host-ram "
            f"{format_size(host_ram)}"
        )
    elif gpu and peaks["device"] > device_mem:
        candidate.reason = (
            f"device peak {format_size(peaks['device'])} > --device-mem {format_size(device_mem)}"
        )
    # Each resource's busy seconds in a step, as the simulation worked them out, and the one
    # with the most, which bounds it.
    candidate.busy = result["resource_seconds"]
    candidate.bound = result["bound"]


# ---------------------------------------------------------------------------- the run


#: --disk measure
MEASURE = "measure"
#: bytes each direction moves in one measurement of --disk measure
MEASURED_BYTES = 256 << 20


def disk_profile(
    args: argparse.Namespace, drives: int, measured: DiskProfile | None = None
) -> DiskProfile:
    """One rank's share of ``drives`` drives of the --disk / --disk-gbps profile, or of
    ``measured`` (one drive, measured here for --disk measure)."""
    if args.disk is not None and args.disk_gbps is not None:
        raise UserError("pass either --disk or --disk-gbps, not both")
    if measured is not None:
        single = measured
    elif args.disk == MEASURE:
        raise UserError("--disk measure: the disk is measured per candidate, after recording")
    elif args.disk is not None:
        if not Path(args.disk).is_file():
            raise UserError(
                f"--disk {args.disk} does not exist: pass infinity-bench --json "
                f"output, --disk measure, or --disk-gbps READ,WRITE"
            )
        single = DiskProfile.from_bench_json(args.disk, shared=args.disk_shared)
    elif args.disk_gbps is not None:
        read_gbps, write_gbps, combined_gbps = args.disk_gbps
        single = DiskProfile(
            read_gbps,
            write_gbps,
            shared=args.disk_shared,
            source="--disk-gbps",
            combined_gbps=combined_gbps,
        )
    else:
        raise UserError(
            "no disk profile: pass --disk bench.json (infinity-bench --json), --disk measure "
            "or --disk-gbps READ,WRITE"
        )
    striped = single.scaled(drives) if drives > 1 else single
    if args.ranks > 1 and not args.own_drives:
        # One rank's share of drives every rank uses at once.
        return striped.per_rank(args.ranks)
    return striped


class MeasuredDisk:
    """--disk measure: the swap directory's disk in a configuration's own requests, measured
    once per request shape (bytes per buffer, buffers in flight)."""

    def __init__(self, path: Path, shared: bool, nbytes: int = MEASURED_BYTES) -> None:
        self.path = path
        self.shared = shared
        self.nbytes = nbytes
        self.profiles: dict[tuple[int, int], DiskProfile] = {}

    def of(self, config: OffloadConfig) -> DiskProfile:
        shape = (config.swap_buffer_size(), config.buffer_count)
        if shape not in self.profiles:
            probe = config.replace(device="cpu", nvme_path=(self.path,))
            measured = store_disk_profile(self.path, self.nbytes, probe)
            self.profiles[shape] = dataclasses.replace(
                measured, shared=self.shared, source=f"measured here, {_shape_text(shape)}"
            )
            log.info("disk %s", self.profiles[shape])
        return self.profiles[shape]

    def summary(self) -> str:
        """Each measured shape's GB/s, for the table's disk line."""
        return "; ".join(
            f"{_shape_text(shape)}: {p.read_gbps:.3g} read, {p.write_gbps:.3g} write, "
            f"{p.combined_gbps or 0:.3g} both at once"
            for shape, p in sorted(self.profiles.items())
        )


def _shape_text(shape: tuple[int, int]) -> str:
    return f"{format_size(shape[0])} requests x {shape[1]} in flight"


@contextlib.contextmanager
def swap_directory(args: argparse.Namespace) -> Iterator[Path]:
    """Where the recorded steps (and --validate's run) swap: the first --nvme-path, or a
    temporary directory removed afterwards."""
    if args.nvme_path:
        yield args.nvme_path[0]
        return
    temp_dir = Path(tempfile.mkdtemp(prefix="infinity-plan-"))
    try:
        yield temp_dir
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(args: argparse.Namespace, swap_dir: Path) -> Plan:
    if args.steps < 2:
        raise UserError("--steps must be >= 2: the second step gives the compute times")
    measuring = args.disk == MEASURE
    disk_profile(args, 1, _PLACEHOLDER if measuring else None)  # refused before recording
    measured_disk = MeasuredDisk(swap_dir, args.disk_shared) if measuring else None
    given = given_contention(args.contention)  # refused before anything is recorded
    gpu_name = args.device_profile.strip()
    gpu = gpu_name.lower() not in ("this machine", "this", "cpu", "here")
    # The best of a few measurements, before and after the recorded steps: on a shared
    # machine a single one may catch another process's load (the rate is a ceiling).
    rates = [planner.measure_matmul_tflops(repeats=8)] if gpu else []
    device = planner.device_profile(gpu_name, here_tflops=rates[0] if rates else None)
    total_ram = psutil.virtual_memory().total
    host_ram = args.host_ram or total_ram
    # device_profile refused a GPU name without a preset, and every preset has its memory here
    device_mem: int = args.device_mem or (DEVICE_MEMORY[device.name] if gpu else host_ram)
    if args.module is not None:
        source = module_source(args.module, args.args)
    else:
        source = hf_source(args.hf_config)
    if args.seq_len is None and source.inputs != "features":
        args.seq_len = 128
    full = source.make(meta=True)
    params = parameter_count(full)
    scaled = args.scaled or params > args.max_local_params
    if args.validate is not None:
        refused = plan_validation.cannot_validate(args, gpu, scaled, params, total_ram)
        if refused:
            raise UserError(refused)
    if scaled:
        changes, small_params = scaled_changes(
            source, full, args.scaled_layers, args.max_local_params
        )
        torch.manual_seed(0)
        small = source.make(changes)
        small_recording, recorded = record(source, small, args, swap_dir)
        recording = planner_scaled.recording_for_scaled(small, small_recording, full)
        what = (
            f"a scaled-down copy ({', '.join(f'{k}={v}' for k, v in changes.items())}; "
            f"{small_params / 1e6:.1f} M params), extrapolated to the full model"
        )
    else:
        torch.manual_seed(0)
        model = source.make()
        recording, recorded = record(source, model, args, swap_dir)
        del model
        what = "the model itself"
    if gpu:
        rates.append(planner.measure_matmul_tflops(repeats=8))
        here_tflops = max(rates)
        device = planner.device_profile(gpu_name, here_tflops=here_tflops)
    if args.optimizer_gelems is not None:
        recording = dataclasses.replace(
            recording, step_seconds_per_element=1 / (args.optimizer_gelems * 1e9)
        )
        optimizer_source = "--optimizer-gelems"
    elif scaled:
        # A copy's small tensors time the kernel's per-call overhead, not its rate.
        recording = dataclasses.replace(
            recording, step_seconds_per_element=measure_update_seconds(args.optimizer)
        )
        optimizer_source = "measured here on 8M-element tensors"
    else:
        optimizer_source = "measured in the recorded steps"
    contention = given if isinstance(given, Contention) else None
    if given == "measure":
        torch.manual_seed(0)
        contention = measure_contention(
            source, source.make(changes) if scaled else source.make(), args, swap_dir
        )

    def skeleton_of() -> nn.Module:  # a fresh one per simulation (attach takes it over)
        return planner_scaled.skeleton(full, args.ranks)

    skeleton = skeleton_of()
    trainable = sum(p.numel() for p in skeleton.parameters() if p.requires_grad)
    compute_seconds = sum(recording.trace.compute)
    configs = candidates(skeleton, gpu, host_ram, device_mem, args.ranks, recording.base_rss, args)
    tables = []
    for drives in args.drives:
        disk = None if measured_disk else disk_profile(args, drives)
        ranked = []
        for config in configs:
            candidate = Candidate(config)
            if measured_disk is not None and "nvme" in (
                config.offload_param,
                config.offload_optimizer,
            ):
                candidate.disk = disk_profile(args, drives, measured_disk.of(config))
            # a candidate that keeps nothing on NVMe has no disk to measure
            on = candidate.disk or disk or _PLACEHOLDER
            evaluate(
                candidate,
                skeleton_of,
                recording,
                on,
                device,
                gpu,
                host_ram,
                device_mem,
                args.ranks,
                contention,
            )
            ranked.append(candidate)
        ranked.sort(
            key=lambda c: (not c.fits, c.result.get("step_seconds", math.inf) if c.fits else 0.0)
        )
        if disk is None:  # measured per candidate: the table shows the best's, and names all
            assert measured_disk is not None
            best = next((c.disk for c in ranked if c.disk is not None), _PLACEHOLDER)
            disk = dataclasses.replace(
                best, source=f"measured here per candidate: {measured_disk.summary() or 'none'}"
            )
        tables.append(Table(drives, disk, ranked))
    tokens = args.batch * (args.seq_len or 1)
    ideal = ""
    if gpu:
        tflops = planner.GPU_PRESETS[device.name][0] * planner.GPU_EFFICIENCY
        if source.inputs != "features":
            ideal = (
                f"; 6 x params x tokens at {tflops:.0f} TFLOP/s would be "
                f"{6 * params * tokens / (tflops * 1e12):.3g} s"
            )
    header = [
        (
            "model",
            f"{source.label}: {params / 1e6:,.1f} M params"
            + (
                f", batch {args.batch} x {args.seq_len} tokens"
                if args.seq_len
                else f", batch {args.batch}"
            ),
        ),
        (
            "recorded",
            f"{args.steps} steps of {what} here: {recorded['step_seconds']:.2f} s/step,"
            f" compute {recorded['compute_seconds']:.3f} s",
        ),
        (
            "compute",
            f"{compute_seconds:.3g} s here x {device.compute_scale:.3g} ({device.name}"
            f"{'' if not gpu else f', matmul {here_tflops:.3f} TFLOP/s here'}) = "
            f"{compute_seconds * device.compute_scale:.3g} s per step{ideal}",
        ),
        (
            "optimizer",
            f"{recording.step_seconds_per_element * 1e9:.3g} ns per element "
            f"({optimizer_source}); {trainable / 1e6:,.1f} M elements per rank",
        ),
        (
            "device",
            f"{device.name}"
            + (
                f", link {device.link_gbps:g} GB/s, {format_size(device_mem)} per rank"
                if gpu
                else ""
            ),
        ),
        (
            "ranks",
            f"{args.ranks} (ZeRO-3: each holds and moves 1/{args.ranks} of the state)"
            if args.ranks > 1
            else "1",
        ),
        ("host RAM", format_size(host_ram)),
        (
            "contention",
            f"compute x {contention.compute_slowdown:.2f} beside the disk, the disk keeps "
            f"{contention.io_retained:.0%} beside compute ({contention.source})"
            if contention is not None
            else "not measured: compute and the disk are taken not to slow each other "
            "(--contention measure)",
        ),
    ]
    data = {
        "model": source.label,
        "parameters": params,
        "scaled": scaled,
        "recorded": recorded,
        "tokens_per_step": tokens * args.ranks,
        "ranks": args.ranks,
        "device": dataclasses.asdict(device),
        "compute_seconds_here": compute_seconds,
        "step_seconds_per_element": recording.step_seconds_per_element,
        "contention": contention.as_dict() if contention is not None else None,
        "tables": [
            {
                "drives": t.drives,
                "disk": dataclasses.asdict(t.disk),
                "candidates": [candidate_json(c, tokens * args.ranks) for c in t.ranked],
            }
            for t in tables
        ],
    }

    def replay(config: OffloadConfig, disk: DiskProfile, iterations: int) -> dict[str, Any]:
        return planner.simulate(
            skeleton_of(),
            recording,
            config.replace(device="cpu"),
            disk,
            device,
            iterations=iterations,
            cpu_memory=not gpu,
            contention=contention,
        )

    return Plan(header, tables, tokens, args.ranks, data, replay)


def write_config(plan: Plan, path: Path) -> OffloadConfig:
    best = next((c for c in plan.ranked if c.fits), None)
    if best is None:
        raise UserError(
            f"no candidate fits, so there is nothing to write to {path}: raise "
            f"--host-ram or --device-mem, or add drives"
        )
    try:
        path.write_text(json.dumps(best.config.to_dict(), indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"--write-config {path}: {exc.strerror or exc}") from None
    return best.config


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(__doc__ or "")
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    if not args.verbose:
        quiet_transformers()

    def plan_and_write() -> None:
        with swap_directory(args) as swap_dir:
            plan = run(args, swap_dir)
            print("\n".join(table(plan, args.top)), flush=True)
            if args.write_config is not None:
                write_config(plan, args.write_config)
                print(
                    f"\nwrote the best candidate to {args.write_config} "
                    f"(OffloadConfig.from_file loads it)"
                )
            if args.validate is not None:
                validation = plan_validation.validate(plan, args, swap_dir, args.validate)
                plan.json["validation"] = validation
                print("\n".join(plan_validation.lines(validation)))
        if args.json is not None:
            args.json.write_text(json.dumps(plan.json, indent=1, default=str) + "\n")

    return guarded(parser.prog, plan_and_write, USER_ERRORS)[0]


if __name__ == "__main__":
    raise SystemExit(main())
