"""What the planner replays a recording against: the drives (:class:`DiskProfile`) and where the
modules compute (:class:`DeviceProfile`, from this machine or a GPU preset scaled against this
machine's measured matmul rate). ``infinity.planning.planner`` re-exports them."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from infinity.errors import InfinityError


class PlanError(InfinityError, ValueError):
    """A prediction was asked for what cannot be predicted (no recorded step, a bad profile)."""


# -- profiles -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskProfile:
    """What the drives do: GB/s (10**9 bytes) for reads and writes, and whether the two share
    one budget (a read slows a write down, as on this machine's virtio disk and most single
    NVMe drives under mixed load) or run side by side. ``combined_gbps``, where measured, is
    the bytes of both directions per second of a pass that reads and writes as much at once
    (``engine_bandwidth(combined=True)`` of ``infinity.cli.common.transfers``): below what the
    two alone imply, the replay slows the disk to it while reads and writes are both in flight."""

    read_gbps: float
    write_gbps: float
    shared: bool = True
    source: str = ""
    combined_gbps: float | None = None

    def __post_init__(self) -> None:
        if not (self.read_gbps > 0 and self.write_gbps > 0):
            raise PlanError(
                f"a disk profile needs read and write GB/s > 0, got "
                f"{self.read_gbps} and {self.write_gbps}"
            )
        if self.combined_gbps is not None and not self.combined_gbps > 0:
            raise PlanError(
                f"a disk profile's combined GB/s must be > 0 (or None: not measured), got "
                f"{self.combined_gbps}"
            )

    @property
    def mixed_efficiency(self) -> float:
        """The combined rate measured over the rate the two directions alone imply for as many
        bytes each way (shared: one after the other; side by side: the slower's pace), at most
        1.0; 1.0 without a combined figure."""
        if self.combined_gbps is None:
            return 1.0
        if self.shared:
            implied = 2.0 / (1.0 / self.read_gbps + 1.0 / self.write_gbps)
        else:
            implied = 2.0 * min(self.read_gbps, self.write_gbps)
        return min(1.0, self.combined_gbps / implied)

    @classmethod
    def from_bench_json(cls, path: str | Path, shared: bool = True) -> DiskProfile:
        """From ``infinity-bench --json`` output: each direction's best engine point."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            best = data["best"]
            read = max(b["read"]["gbps"] for b in best.values() if "read" in b)
            write = max(b["write"]["gbps"] for b in best.values() if "write" in b)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(
                f"{path} is not infinity-bench --json output with read and write "
                f"results ({type(exc).__name__}: {exc}): run infinity-bench "
                f"--path <your nvme_path> --json {path.name}"
            ) from exc
        return cls(read, write, shared, source=str(path))

    def scaled(self, drives: int) -> DiskProfile:
        """``drives`` of these striped (the store stripes requests over its nvme_path list)."""
        return dataclasses.replace(
            self,
            read_gbps=self.read_gbps * drives,
            write_gbps=self.write_gbps * drives,
            combined_gbps=None if self.combined_gbps is None else self.combined_gbps * drives,
            source=f"{drives} x {self.source or 'profile'}",
        )

    def per_rank(self, ranks: int) -> DiskProfile:
        """One rank's share when ``ranks`` ranks use these drives at once."""
        return dataclasses.replace(
            self,
            read_gbps=self.read_gbps / ranks,
            write_gbps=self.write_gbps / ranks,
            combined_gbps=None if self.combined_gbps is None else self.combined_gbps / ranks,
            source=f"{self.source or 'profile'}, shared by {ranks} ranks",
        )


@dataclass(frozen=True)
class DeviceProfile:
    """Where the modules compute: ``compute_scale`` multiplies the recorded compute seconds
    (1 = this machine), ``link_gbps`` is the host<->device bandwidth (None: a CPU device,
    where a copy is a memcpy at the recorded rate)."""

    name: str
    compute_scale: float = 1.0
    link_gbps: float | None = None
    source: str = ""


#: Dense bf16 tensor throughput and host links from the vendors' data sheets. A GPU preset's
#: compute_scale is derived against this machine's measured matmul rate (``device_profile``).
GPU_PRESETS: dict[str, tuple[float, float, str]] = {
    # name: (dense bf16 TFLOP/s, host link GB/s, source)
    "A100": (312.0, 25.0, "NVIDIA A100 data sheet (SXM4, dense BF16 312 TFLOPS; PCIe 4.0 x16)"),
    "H100": (989.0, 50.0, "NVIDIA H100 data sheet (SXM5, dense BF16 989 TFLOPS; PCIe 5.0 x16)"),
    "H200": (989.0, 50.0, "NVIDIA H200 data sheet (SXM, dense BF16 989 TFLOPS; PCIe 5.0 x16)"),
}
#: the share of peak a training step's matmuls reach (MFU); the ZeRO-Infinity paper reports
#: 40-50% of peak for its largest models, so the middle of that
GPU_EFFICIENCY = 0.45


def measure_matmul_tflops(size: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate (TFLOP/s), the base a GPU preset is scaled against. Its
    operands come from a generator of its own: the user's random streams are left alone."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    a @ b
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e12


def device_profile(name: str, here_tflops: float | None = None) -> DeviceProfile:
    """A named preset: ``this machine`` (or ``cpu``), or one of :data:`GPU_PRESETS`."""
    if name.lower() in ("this machine", "this", "cpu", "here"):
        return DeviceProfile("this machine", 1.0, None, "measured in the recorded step")
    key = name.upper()
    if key not in GPU_PRESETS:
        raise PlanError(
            f"unknown device profile {name!r}: use 'this machine' or one of "
            f"{', '.join(GPU_PRESETS)}"
        )
    tflops, link, source = GPU_PRESETS[key]
    here = here_tflops if here_tflops is not None else measure_matmul_tflops()
    return DeviceProfile(
        key,
        here / (tflops * GPU_EFFICIENCY),
        link,
        f"{source}; {GPU_EFFICIENCY:.0%} of peak, against {here:.3f} TFLOP/s measured here",
    )
