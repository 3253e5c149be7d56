"""fio as the reference: what the disk does with O_DIRECT and no Python in the way.

fio is run as a subprocess with ``--output-format=json``; only the fields the comparison needs
are taken from its report. A missing fio is installed with apt only when that is possible
without asking (root and apt-get present); otherwise the bench says so and goes on without it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from infinity.cli.common.machine import DiskCounters
from infinity.cli.common.units import GIB

log = logging.getLogger(__name__)

ENGINES = ("io_uring", "libaio")


class FioError(RuntimeError):
    """fio ran but did not produce a usable result."""


@dataclass(frozen=True, order=True)
class FioJob:
    rw: str  # "read" or "write"
    block_size: int
    iodepth: int
    size: int
    ioengine: str = "io_uring"
    runtime: float = 0.0  # > 0: loop over the file for this many seconds instead of once

    def command(self, fio: str, filename: Path) -> list[str]:
        command = [
            fio,
            "--name=infinity-bench",
            f"--filename={filename}",
            "--direct=1",
            f"--ioengine={self.ioengine}",
            f"--rw={self.rw}",
            f"--bs={self.block_size}",
            f"--iodepth={self.iodepth}",
            f"--size={self.size}",
            "--numjobs=1",
            # Anonymous mmap memory, as the engine's buffer pool: with fio's default
            # (malloc) reads measured up to 2x slower on a virtio disk, because the
            # buffers' pages differ, not the disk.
            "--iomem=mmap",
            "--output-format=json",
        ]
        if self.runtime > 0:
            command += ["--time_based", f"--runtime={int(self.runtime * 1000)}ms"]
        return command


@dataclass(frozen=True)
class FioResult:
    rw: str
    io_bytes: int
    runtime_s: float  # fio's own job runtime, which leaves out its setup
    bw_bytes: float  # bytes per second as fio reports it
    cpu_s: float  # user + system of the job
    device_request_bytes: float | None = None  # mean size of the requests the disk saw

    @property
    def gbps(self) -> float:
        return self.bw_bytes / 1e9

    @property
    def cpu_per_gib(self) -> float:
        return self.cpu_s / (self.io_bytes / GIB) if self.io_bytes else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(gbps=self.gbps, cpu_s_per_gib=self.cpu_per_gib)
        return out


def parse_fio_json(text: str, rw: str) -> FioResult:
    """The ``rw`` side ("read"/"write") of the first job in fio's JSON report.

    fio prints warnings ("fio: ...") on stdout ahead of the JSON in some versions, so the
    document is taken from the first line that opens an object."""
    start = text.find("\n{")
    start = 0 if text.startswith("{") else (start + 1 if start >= 0 else -1)
    if start < 0:
        raise FioError(f"no JSON in fio output: {text[:200]!r}")
    try:
        report = json.loads(text[start : text.rfind("}") + 1])
    except json.JSONDecodeError as exc:
        raise FioError(f"fio output is not valid JSON: {exc}") from exc
    jobs = report.get("jobs") or []
    if not jobs:
        raise FioError("fio report has no jobs")
    job = jobs[0]
    if job.get("error"):
        raise FioError(
            f"fio job failed with error {job['error']} "
            f"({os.strerror(job['error']) if job['error'] > 0 else '?'})"
        )
    side = job.get(rw)
    if not side or not side.get("io_bytes"):
        raise FioError(f"fio report has no {rw} data")
    runtime_ms = float(side.get("runtime") or job.get("job_runtime") or 0)
    io_bytes = int(side["io_bytes"])
    bw_bytes = float(side.get("bw_bytes") or (io_bytes / (runtime_ms / 1000) if runtime_ms else 0))
    job_runtime_s = float(job.get("job_runtime", runtime_ms)) / 1000
    cpu = (float(job.get("usr_cpu", 0)) + float(job.get("sys_cpu", 0))) / 100 * job_runtime_s
    return FioResult(
        rw=rw, io_bytes=io_bytes, runtime_s=runtime_ms / 1000, bw_bytes=bw_bytes, cpu_s=cpu
    )


def find_fio(install: bool = True) -> tuple[str | None, str]:
    """(path to fio or None, a note for the report)."""
    path = shutil.which("fio")
    if path:
        return path, version(path)
    if not install:
        return None, "fio not found on PATH"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, (
            "fio not found on PATH, and it cannot be installed here (needs root and apt-get)"
        )
    log.info("fio not found; trying apt-get install -y fio")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(
            ["apt-get", "install", "-y", "fio"],
            check=True,
            capture_output=True,
            timeout=120,
            env=env,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return None, (
            f"fio not found and apt-get install fio failed: "
            f"{detail.decode(errors='replace').strip()[-200:] or exc}"
        )
    path = shutil.which("fio")
    return (path, version(path)) if path else (None, "apt-get installed fio but it is not on PATH")


def version(fio: str) -> str:
    try:
        out = subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        return f"unknown ({exc})"


class FioRunner:
    """Runs fio jobs against one file under the bench directory and removes it at the end.

    The file is written once before any measured job, so measured writes are overwrites and
    measured reads find data, matching what the engine passes see."""

    def __init__(
        self,
        fio: str,
        directory: Path,
        size: int,
        timeout: float = 600,
        disk: DiskCounters | None = None,
    ) -> None:
        self.fio = fio
        self.disk = disk
        self.directory = directory
        self.filename = directory / "fio.dat"
        self.size = size
        self.timeout = timeout
        self.ioengine: str | None = None
        self.note = ""

    def prepare(self) -> bool:
        """Lays out the file with the first engine that works; False when none does."""
        errors = []
        for engine in ENGINES:
            job = FioJob("write", 1 << 20, 8, self.size, engine)
            try:
                self.run(job)
            except FioError as exc:
                errors.append(f"{engine}: {exc}")
                log.info("fio with %s does not work here: %s", engine, exc)
                continue
            self.ioengine = engine
            return True
        self.note = "fio could not run with O_DIRECT here: " + "; ".join(errors)
        return False

    def run(self, job: FioJob) -> FioResult:
        before = self.disk.snapshot() if self.disk else None
        result = self.finish(self.spawn(job), job)
        if self.disk and before is not None:
            mean = DiskCounters.average_request(before, self.disk.snapshot(), job.rw)
            result = replace(result, device_request_bytes=mean)
        return result

    def spawn(self, job: FioJob) -> subprocess.Popen:
        try:
            return subprocess.Popen(
                job.command(self.fio, self.filename),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as exc:
            raise FioError(f"cannot run fio: {exc}") from exc

    def finish(self, process: subprocess.Popen, job: FioJob) -> FioResult:
        try:
            stdout, stderr = process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            process.communicate()
            raise FioError(f"fio timed out after {self.timeout:g} s") from exc
        try:
            return parse_fio_json(stdout, job.rw)
        except FioError as exc:
            tail = stderr.strip().splitlines()[-1:] if stderr else []
            raise FioError(
                f"{exc}{'; ' + tail[0] if tail else ''} (exit {process.returncode})"
            ) from exc

    def cleanup(self) -> None:
        self.filename.unlink(missing_ok=True)
