"""Swap directories of runs that died (SIGKILL) are reclaimed by the next run on the same
nvme_path; live runs' directories, kept ones and anything not ours are never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import infinity
from swap import EngineSettings, SwapEngine
from swap.files import RUN_DIR_PREFIX
from swap.leftovers import KEPT_NAME, LOCK_NAME, find_leftovers
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
