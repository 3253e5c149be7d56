"""What a result depends on besides the code: the machine, the file system and the device."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def mount_of(path: Path) -> dict:
    """The /proc/mounts entry with the longest mount point containing ``path``."""
    path = path.resolve()
    best: dict = {}
    for line in (_read(Path("/proc/mounts")) or "").splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount_point = fields[1].replace("\\040", " ")
        if (path == Path(mount_point) or Path(mount_point) in path.parents) and len(
            mount_point
        ) >= len(best.get("mount_point", "")):
            best = {
                "device": fields[0],
                "mount_point": mount_point,
                "fstype": fields[2],
                "options": fields[3],
            }
    return best


def block_device(path: Path) -> dict:
    """The queue settings of the block device holding ``path`` (whole disk, when a partition)."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sys_dev.exists():
        return {}
    real = sys_dev.resolve()
    disk = real.parent if (real / "partition").exists() else real
    queue = disk / "queue"
    info: dict = {"name": disk.name}
    for key in (
        "rotational",
        "scheduler",
        "max_sectors_kb",
        "nr_requests",
        "logical_block_size",
        "physical_block_size",
    ):
        value = _read(queue / key)
        if value is not None:
            info[key] = value
    model = _read(disk / "device" / "model")
    if model:
        info["model"] = model
    return info


def cpu_model() -> str:
    for line in (_read(Path("/proc/cpuinfo")) or "").splitlines():
        if line.lower().startswith(("model name", "cpu model")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_info(path: Path) -> dict:
    import numpy
    import torch

    try:
        import psutil

        memory = psutil.virtual_memory().total
    except ImportError:  # psutil is a dependency, but the report must not need it
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        from importlib.metadata import version

        liburing = version("liburing")
    except Exception:
        liburing = None
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "liburing": liburing,
        "cuda": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "loadavg": os.getloadavg(),
        "memory_bytes": memory,
        "path": str(path),
        "mount": mount_of(path),
        "block_device": block_device(path),
        "free_bytes": shutil.disk_usage(path).free,
        "git_commit": git_commit(Path(__file__).resolve().parents[3]),
    }


class DiskCounters:
    """Requests and bytes the block device under ``path`` completed, from its sysfs ``stat``.

    Shows how the kernel cut the I/O: on a virtio disk, buffers whose pages are not physically
    contiguous are split into smaller device requests (the queue's segment limit), which can
    matter more than anything the submitting code does."""

    def __init__(self, path: Path) -> None:
        dev = os.stat(path).st_dev
        self.file = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
        self.available = self.file.exists()

    def snapshot(self) -> tuple[int, int, int, int]:
        """(reads, bytes read, writes, bytes written) since boot; zeros when unavailable."""
        if not self.available:
            return (0, 0, 0, 0)
        try:
            fields = self.file.read_text().split()
            return int(fields[0]), int(fields[2]) * 512, int(fields[4]), int(fields[6]) * 512
        except (OSError, ValueError, IndexError):
            return (0, 0, 0, 0)

    @staticmethod
    def average_request(before: tuple[int, ...], after: tuple[int, ...], op: str) -> float | None:
        """Mean bytes per device request of ``op`` between two snapshots."""
        count, nbytes = (0, 1) if op == "read" else (2, 3)
        requests = after[count] - before[count]
        return (after[nbytes] - before[nbytes]) / requests if requests > 0 else None
