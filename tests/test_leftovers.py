"""Swap directories of runs that died (SIGKILL) are reclaimed by the next run on the same
nvme_path; live runs' directories, kept ones and anything not ours are never touched; runs
starting side by side (a job's ranks restarted together) neither remove a new run's directory
nor trip over one another's reclaiming; a forked child left behind by a dead run does not keep
its directory from being reclaimed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import infinity
import swap.leftovers
from swap import EngineSettings, SwapEngine
from swap.files import RUN_DIR_PREFIX
from swap.leftovers import KEPT_NAME, LOCK_NAME, find_leftovers, reclaim_leftovers
from tests.store_helpers import fused_adamw, make_model, train

ROOT = Path(__file__).resolve().parents[1]

# Attaches a small model with everything on NVMe under the given path, trains a step, then dies
# the way the OOM killer kills: no cleanup runs.
_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    import infinity
    from tests.store_helpers import fused_adamw, make_model, train
    store = infinity.TieredStore(infinity.OffloadConfig(
        offload_param="nvme", offload_optimizer="nvme", buffer_size=8192, buffer_count=8,
        nvme_path=sys.argv[1]))
    model = make_model()
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    train(model, optimizer, 1)
    print(store.engine.space.run_dirs[0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed_run(path: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -9, result.stderr[-2000:]
    run_dir = Path(result.stdout.strip())
    assert run_dir.is_dir() and any(p.name.startswith("swap-") for p in run_dir.iterdir())
    return run_dir


def _decoys(path: Path, elsewhere: Path) -> list[Path]:
    """Names a careless reclaimer would remove: a prefixed directory without a lock (a run of
    an older version, or one being created), a prefixed plain file, a prefixed symlink to a
    directory holding a free lock, and an unprefixed directory holding a free lock."""
    no_lock = path / f"{RUN_DIR_PREFIX}nolock"
    no_lock.mkdir()
    (no_lock / "data").write_bytes(b"keep me")
    plain_file = path / f"{RUN_DIR_PREFIX}file"
    plain_file.write_bytes(b"keep me")
    target = elsewhere / "target"
    target.mkdir()
    (target / LOCK_NAME).write_text("0\n")
    link = path / f"{RUN_DIR_PREFIX}link"
    link.symlink_to(target)
    other = path / "not-ours"
    other.mkdir()
    (other / LOCK_NAME).write_text("0\n")
    return [no_lock, plain_file, link, target, other]


def test_a_killed_runs_directory_is_reclaimed_and_nothing_else(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (tmp_path / "elsewhere").mkdir()
    settings = EngineSettings(file_size=1 << 20)
    live = [SwapEngine(nvme, settings) for _ in range(2)]  # two live runs
    for engine in live:
        engine.allocate(4096)
    kept = SwapEngine(nvme, settings, keep_files=True)  # one kept on purpose
    kept.allocate(4096)
    (kept_dir,) = kept.space.run_dirs
    kept.close()
    assert (kept_dir / KEPT_NAME).exists() and not (kept_dir / LOCK_NAME).exists()
    dead = _killed_run(nvme)  # and one killed
    decoys = _decoys(nvme, tmp_path / "elsewhere")
    live_dirs = [d for engine in live for d in engine.space.run_dirs]

    found = find_leftovers(nvme, RUN_DIR_PREFIX)  # reporting removes nothing
    assert [f.path for f in found] == [dead] and found[0].nbytes > 0 and dead.exists()

    with infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            buffer_size=8192,
            buffer_count=8,
            nvme_path=str(nvme),
        )
    ) as store:
        model = make_model()
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        assert [f.path for f in store.engine.space.reclaimed] == [dead]
        train(model, optimizer, 1)
    assert not dead.exists()
    for path in live_dirs + [kept_dir] + decoys:
        assert os.path.lexists(path), path
    assert (decoys[0] / "data").read_bytes() == b"keep me"
    for engine in live:
        engine.close()
    assert all(not d.exists() for d in live_dirs)


def test_a_run_reclaims_only_once_its_owner_is_gone(tmp_path):
    """A live run's lock cannot be taken: nothing reclaims its directory, even while it is in
    the middle of being used; after close nothing is left to reclaim."""
    settings = EngineSettings(file_size=1 << 20)
    with SwapEngine(tmp_path, settings) as first:
        first.allocate(4096)
        with SwapEngine(tmp_path, settings) as second:
            assert second.space.reclaimed == []
            assert find_leftovers(tmp_path, RUN_DIR_PREFIX) == []
        assert first.space.run_dirs[0].exists()
    assert list(tmp_path.iterdir()) == []


def _reclaiming_at_first_flock(monkeypatch, root: Path, reclaimed: list) -> None:
    """Another run reclaiming ``root`` exactly when this process next takes a lock: after the
    lock file was opened, before it is locked (what a second process can hit at any time)."""
    real = swap.leftovers.fcntl.flock
    armed = [True]

    def flock(fd, operation):
        if armed[0]:
            armed[0] = False
            reclaimed.extend(reclaim_leftovers(root, RUN_DIR_PREFIX))
        return real(fd, operation)

    monkeypatch.setattr(swap.leftovers.fcntl, "flock", flock)


def test_a_run_starting_while_another_reclaims_keeps_its_directory(tmp_path, monkeypatch):
    reclaimed: list = []
    _reclaiming_at_first_flock(monkeypatch, tmp_path, reclaimed)
    with SwapEngine(tmp_path, EngineSettings(file_size=1 << 20)) as engine:
        (run_dir,) = engine.space.run_dirs
        assert reclaimed == [] and run_dir.is_dir()
        assert (run_dir / LOCK_NAME).is_file()
        engine.allocate(4096)  # its files go into its directory, still there
        assert find_leftovers(tmp_path, RUN_DIR_PREFIX) == []
    assert list(tmp_path.iterdir()) == []


def test_two_runs_reclaiming_one_directory_at_once_remove_it_once_quietly(
    tmp_path, monkeypatch, caplog
):
    dead = _killed_run(tmp_path)
    by_the_other: list = []
    _reclaiming_at_first_flock(monkeypatch, tmp_path, by_the_other)
    with caplog.at_level(logging.WARNING, logger="swap.leftovers"):
        # The other takes the lock first and removes the directory while this one waits on it.
        mine = reclaim_leftovers(tmp_path, RUN_DIR_PREFIX)
    assert [f.path for f in by_the_other] == [dead] and mine == []
    assert not dead.exists()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "removed the swap directory" in warnings[0], warnings


# A run that forks a child (as a DataLoader worker is forked), then dies by SIGKILL while the
# child lives on.
_KILLED_RUN_WITH_A_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from swap import EngineSettings, SwapEngine
    engine = SwapEngine(sys.argv[1], EngineSettings(file_size=1 << 20))
    engine.allocate(4096)
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the test reads the parent's output to its end
            os.dup2(null, fd)
        time.sleep(120)
        os._exit(0)
    print(engine.space.run_dirs[0], child, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_dead_runs_directory_is_reclaimed_while_its_forked_child_lingers(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_RUN_WITH_A_CHILD, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    run_dir, child = result.stdout.split()
    try:
        os.kill(int(child), 0)  # the child still runs, holding what it inherited
        assert [f.path for f in reclaim_leftovers(tmp_path, RUN_DIR_PREFIX)] == [Path(run_dir)]
        assert list(tmp_path.iterdir()) == []
    finally:
        try:
            os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pytest.fail("the forked child was gone before the directory was reclaimed")
