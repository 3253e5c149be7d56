"""Shared fixtures for the swap-layer tests: engines per backend, pools, tmpfs mounts."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Under pytest-xdist (make test runs one worker per core) each worker computes with one torch
# thread, and so do the processes the tests start (they inherit the environment): the workers
# share the cores instead of each spinning a thread pool across all of them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # after the thread settings, which torch reads when it loads

import swap.probe
from swap import BufferPool, EngineSettings, SwapConfigError, SwapEngine
from tests.snippet_runner import SnippetRunner

#: every backend a real engine can run on; "uring" is skipped where io_uring is unavailable
REAL_BACKENDS = ("uring", "threads", "buffered")


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (longest mount-point prefix)."""
    target = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(
                point
            ) >= len(best):
                best, kind = point, fields[2]
    return kind


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` reproducible random bytes as a uint8 tensor."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def fill(buffer, data: torch.Tensor, offset: int = 0) -> None:
    buffer.tensor[offset : offset + data.numel()].copy_(data)


def contents(buffer, nbytes: int, offset: int = 0) -> torch.Tensor:
    return buffer.tensor[offset : offset + nbytes].clone()


@pytest.fixture
def launch_environment_restored() -> Iterator[None]:
    """Lightning's DDP-based strategies (InfinityStrategy among them) set torchrun's variables
    (WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) in the process's environment even on one
    device; a later test in the same worker would then take itself for a rank of a launch
    (accelerate and Trainer start a process group). The environment goes back as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def snippet_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnippetRunner]:
    """Runs the README's and the docs' blocks, each as a script in a process of its own, forked
    from one server that imported torch and infinity once (tests/snippet_runner.py)."""
    root = Path(__file__).resolve().parents[1]
    log = tmp_path_factory.mktemp("snippet-server") / "stderr"
    runner = SnippetRunner({**os.environ, "PYTHONPATH": str(root)}, log)
    yield runner
    runner.close()


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A directory on a block-device file system (not tmpfs), where O_DIRECT is real."""
    if fs_type(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"{tmp_path} is on {fs_type(tmp_path)}, not on a disk file system")
    return tmp_path


@pytest.fixture
def fresh_probe_cache() -> Iterator[None]:
    """Backend probe results are cached per device for the process: tests that fake a probe
    start and end with an empty cache so they neither see nor leave a stale answer."""
    swap.probe.clear_probe_cache()
    yield
    swap.probe.clear_probe_cache()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., SwapEngine]]:
    """Builds engines (``make_engine(dirs, backend=..., **settings)``), closed at teardown."""
    engines: list[SwapEngine] = []

    def build(
        dirs, backend: str = "auto", *, keep_files: bool = False, io=None, **settings
    ) -> SwapEngine:
        settings.setdefault("file_size", 1 << 20)
        settings.setdefault("block_size", 64 << 10)
        # One checksum per request, so tests can name the request a fault hit; the tests of
        # chunks spanning several requests (and of the default) pass checksum_chunk.
        settings.setdefault("checksum_chunk", settings["block_size"])
        try:
            engine = SwapEngine(
                dirs, EngineSettings(backend=backend, **settings), keep_files=keep_files, backend=io
            )
        except SwapConfigError as exc:
            if backend == "uring" and "uring" in str(exc):
                pytest.skip(f"io_uring unavailable here: {exc}")
            raise
        engines.append(engine)
        return engine

    yield build
    for engine in reversed(engines):
        engine.close()


@pytest.fixture
def pool() -> Iterator[BufferPool]:
    with BufferPool(8, 256 << 10, name="test") as p:
        yield p


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount_tmpfs(size="1m", ro=False)`` mounts a fresh tmpfs and returns its directory;
    unmounted at teardown. Skips the test where mounting is not permitted."""
    mounted: list[Path] = []

    def mount(size: str = "1m", ro: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        options = f"size={size},mode=0755" + (",ro" if ro else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast and steadier on a busy machine (modules opt
    in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stores() -> Iterator[list]:
    """Stores opened by a test; closed at teardown even when the test fails."""
    opened: list = []
    yield opened
    for store in opened:
        store.close()


#: modules whose cases run whole trainings, several ranks or fresh processes: ``make test-fast``
#: (``-m "not slow"``) leaves them out for the edit loop; ``make test`` runs everything.
SLOW_MODULES = frozenset(
    {
        "test_bench_clip",
        "test_bench_tool",
        "test_checkpoint",
        "test_compile",
        "test_elastic",
        "test_grad_access",
        "test_heap_bound",
        "test_kv_offload",
        "test_latest_checkpoint",
        "test_leftovers",
        "test_optimizer_checkpoint",
        "test_param_access",
        "test_planner",
        "test_precision",
        "test_ranks",
        "test_rss_bound",
        "test_security",
        "test_state_dtype",
        "test_step_in_backward",
        "test_store_budgets",
        "test_store_equivalence",
        "test_store_faults",
        "test_store_stress",
        "test_trainer_integrations",
        "test_trainer_loops",
        "test_update_timing",
        "test_zero_offload",
        "test_zero_ranks",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
