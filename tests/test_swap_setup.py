"""Engine setup: backend choice, unusable directories, full disks, and the swap files' safety."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

import pytest
import torch

import swap.engine
import swap.files
import swap.probe
from swap import (
    ALIGNMENT,
    BufferPool,
    EngineSettings,
    NvmePathError,
    SwapConfigError,
    SwapEngine,
    SwapSpace,
    SwapSpaceError,
    choose_backend,
    choose_backend_for,
)
from swap.files import RUN_DIR_PREFIX
from swap.integrity import verify_sidecar
from swap.leftovers import LOCK_NAME
from tests.conftest import contents, fill, fs_type, random_bytes

REFUSED = "the file system refuses O_DIRECT (faked by the test)"


# -- backend selection -------------------------------------------------------------------------
def test_auto_picks_a_direct_backend_on_a_disk_file_system(
    disk_dir, make_engine, fresh_probe_cache
):
    assert fs_type(disk_dir) in ("ext4", "xfs", "btrfs", "f2fs")
    assert choose_backend("auto", disk_dir) in ("uring", "threads")
    engine = make_engine(disk_dir)
    assert engine.backend_name in ("uring", "threads") and engine.backend.direct
    file = engine.allocate(1).segments[0].file
    assert fcntl.fcntl(file.fd, fcntl.F_GETFL) & os.O_DIRECT


def test_no_direct_io_falls_back_to_buffered_with_a_warning(
    disk_dir, make_engine, pool, fresh_probe_cache, monkeypatch, caplog
):
    monkeypatch.setattr(swap.probe, "probe_direct_io", lambda directory: REFUSED)
    with caplog.at_level(logging.WARNING, logger="swap.probe"):
        engine = make_engine(disk_dir)
    assert engine.backend_name == "buffered" and not engine.backend.direct
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning and REFUSED in warning[0].getMessage() and "buffered" in warning[0].getMessage()
    extent = engine.allocate(5000)
    file = extent.segments[0].file
    assert not fcntl.fcntl(file.fd, fcntl.F_GETFL) & os.O_DIRECT
    buffer = pool.acquire()
    data = random_bytes(5000, 1)
    fill(buffer, data)
    engine.write_sync(extent, buffer)
    buffer.array[:] = 0
    engine.read_sync(extent, buffer)
    assert torch.equal(contents(buffer, 5000), data)


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_explicit_direct_backend_without_direct_io_raises(
    disk_dir, fresh_probe_cache, monkeypatch, backend
):
    monkeypatch.setattr(swap.probe, "probe_direct_io", lambda directory: REFUSED)
    with pytest.raises(NvmePathError, match=f"'{backend}' needs O_DIRECT") as info:
        SwapEngine(disk_dir, EngineSettings(backend=backend))
    assert str(disk_dir) in str(info.value)
    assert list(disk_dir.iterdir()) == []


def test_unknown_backend_is_a_config_error(disk_dir):
    with pytest.raises(SwapConfigError, match="unknown aio backend 'spdk'"):
        SwapEngine(disk_dir, EngineSettings(backend="spdk"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 1000),
        ("queue_depth", 0),
        ("file_size", -1),
        ("thread_count", 0),
        ("close_timeout", 0),
        ("block_size", True),
    ],
)
def test_bad_settings_are_config_errors(field, value):
    with pytest.raises(SwapConfigError, match=field):
        EngineSettings(**{field: value})


def test_one_directory_without_direct_io_makes_all_buffered(
    disk_dir, mount_tmpfs, fresh_probe_cache, monkeypatch, caplog
):
    other = mount_tmpfs("1m").resolve()  # another device: probed (and cached) on its own
    real = swap.probe.probe_direct_io
    monkeypatch.setattr(
        swap.probe, "probe_direct_io", lambda d: REFUSED if Path(d).resolve() == other else real(d)
    )
    with caplog.at_level(logging.WARNING, logger="swap.probe"):
        assert choose_backend_for("auto", [disk_dir, other]) == "buffered"
    assert any("different backends" in r.getMessage() for r in caplog.records)
    with pytest.raises(NvmePathError, match=str(other)):
        choose_backend_for("threads", [disk_dir, other])


# -- unusable directories ----------------------------------------------------------------------
def _assert_refused(paths, culprit: Path, leftovers: list[Path], match: str | None = None) -> None:
    before = {p: sorted(p.iterdir()) for p in leftovers}
    with pytest.raises(NvmePathError, match=match) as info:
        SwapEngine(paths, EngineSettings(file_size=1 << 20))
    assert str(culprit) in str(info.value)
    assert {p: sorted(p.iterdir()) for p in leftovers} == before  # nothing created anywhere


def test_missing_directory(tmp_path):
    missing = tmp_path / "no" / "such"
    _assert_refused(missing, missing, [tmp_path], match="does not exist")
    assert not missing.exists()


def test_file_instead_of_directory(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    _assert_refused(plain, plain, [tmp_path], match="not a directory")
    assert plain.read_bytes() == b"x"


def test_read_only_directory(mount_tmpfs):
    read_only = mount_tmpfs("1m", ro=True)
    _assert_refused(read_only, read_only, [read_only], match="read-only")


def test_bad_second_directory_leaves_the_first_untouched(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    _assert_refused([good, bad], bad, [good, tmp_path])


def test_unwritable_directory_the_checks_miss(mount_tmpfs, monkeypatch, fresh_probe_cache):
    """If the up-front checks are fooled (NFS, ACLs, a remount in between), creating the probe
    and swap files fails cleanly too."""
    read_only = mount_tmpfs("1m", ro=True)
    monkeypatch.setattr(swap.engine, "check_directory", lambda path: Path(path).resolve())
    monkeypatch.setattr(swap.files, "check_directory", lambda path: Path(path).resolve())
    _assert_refused(read_only, read_only, [read_only], match="cannot create")
    with pytest.raises(NvmePathError, match=str(read_only)):
        SwapSpace([read_only], direct=False)


# -- full disk ---------------------------------------------------------------------------------
def test_full_disk_raises_and_keeps_earlier_extents(mount_tmpfs, make_engine):
    small = mount_tmpfs("1m")
    file_size = 256 << 10
    engine = make_engine(small, file_size=file_size)
    with BufferPool(1, file_size) as pool:
        buffer = pool.acquire()
        written = []
        with pytest.raises(SwapSpaceError) as info:
            for seed in range(8):  # 1 MiB holds at most 4 files of 256 KiB
                extent = engine.allocate(200_000)
                data = random_bytes(200_000, seed)
                fill(buffer, data)
                engine.write_sync(extent, buffer)
                written.append((extent, data))
        error = info.value
        assert 1 <= len(written) <= 4
        assert str(small) in str(error) and str(file_size) in str(error)
        assert str(error.available) in str(error)
        assert error.needed == file_size and error.available < file_size
        assert error.path is not None and error.path.parent.parent == small
        assert not error.path.exists()  # the failed file is not left half-allocated
        with pytest.raises(SwapSpaceError, match=str(8 << 20)):
            engine.allocate(8 << 20)
        (run_dir,) = small.iterdir()
        assert len([p for p in run_dir.iterdir() if p.name != LOCK_NAME]) == len(written)
        for extent, data in written:
            buffer.array[:] = 0
            engine.read_sync(extent, buffer)
            assert torch.equal(contents(buffer, 200_000), data)


# -- security ----------------------------------------------------------------------------------
def test_private_modes_whatever_the_umask(tmp_path, make_engine):
    old = os.umask(0)
    try:
        engine = make_engine(tmp_path)
        extents = [engine.allocate(1 << 20) for _ in range(2)]  # two files
    finally:
        os.umask(old)
    (run_dir,) = engine.space.run_dirs
    assert run_dir.parent == tmp_path.resolve() and run_dir.name.startswith(RUN_DIR_PREFIX)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    files = sorted(p for p in run_dir.iterdir() if p.name != LOCK_NAME)
    assert len(files) == 2 and {e.segments[0].file.path for e in extents} == set(files)
    for path in files + [run_dir / LOCK_NAME]:
        info = path.lstat()
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600


def test_files_removed_on_close(tmp_path):
    engine = SwapEngine(tmp_path, EngineSettings(file_size=1 << 20))
    engine.allocate(10)
    assert len(list(tmp_path.iterdir())) == 1
    engine.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        engine.allocate(10)


def test_keep_files_keeps_them_with_the_data(tmp_path, pool):
    engine = SwapEngine(tmp_path, EngineSettings(file_size=1 << 20), keep_files=True)
    extent = engine.allocate(9000)
    buffer = pool.acquire()
    data = random_bytes(9000, 3)
    fill(buffer, data)
    engine.write_sync(extent, buffer)
    path, offset = extent.segments[0].file.path, extent.segments[0].offset
    engine.close()
    with open(path, "rb") as handle:
        handle.seek(offset)
        assert handle.read(9000) == data.numpy().tobytes()
    # the checksums and tags of what the kept files hold lie next to them, as JSON
    sidecar = path.parent / "integrity.json"
    assert verify_sidecar(sidecar) == []
    sidecar.unlink()
    path.unlink()
    kept = path.parent / "kept"  # marks it kept on purpose: no later run reclaims it
    assert kept.exists() and not (path.parent / LOCK_NAME).exists()
    kept.unlink()
    path.parent.rmdir()


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_planted_name_is_refused(tmp_path, make_engine, planted):
    home = tmp_path / "swap"
    home.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    engine = make_engine(home)
    (run_dir,) = engine.space.run_dirs
    trap = run_dir / "swap-0000.bin"
    if planted == "symlink":
        trap.symlink_to(victim)
    else:
        trap.write_bytes(b"planted")
    with pytest.raises(NvmePathError, match="refusing") as info:
        engine.allocate(ALIGNMENT)
    assert str(trap) in str(info.value)
    assert victim.read_bytes() == b"precious"  # not followed, not truncated
    assert trap.is_symlink() == (planted == "symlink") and os.path.lexists(trap)
    trap.unlink()  # so teardown can remove the run dir


def test_two_engines_on_one_path_never_collide(tmp_path, make_engine, pool):
    first, second = make_engine(tmp_path), make_engine(tmp_path)
    assert first.space.run_dirs != second.space.run_dirs
    a, b = first.allocate(50_000), second.allocate(50_000)
    assert a.segments[0].offset == b.segments[0].offset  # same place in different files
    assert a.segments[0].file.path != b.segments[0].file.path
    buf_a, buf_b = pool.acquire(), pool.acquire()
    data_a, data_b = random_bytes(50_000, 1), random_bytes(50_000, 2)
    fill(buf_a, data_a)
    fill(buf_b, data_b)
    first.write_sync(a, buf_a)
    second.write_sync(b, buf_b)
    first.close()
    buf_b.array[:] = 0
    second.read_sync(b, buf_b)
    assert torch.equal(contents(buf_b, 50_000), data_b)
    assert [p.name for p in tmp_path.iterdir()] == [second.space.run_dirs[0].name]


def test_file_system_without_fallocate_still_works(
    tmp_path, make_engine, pool, monkeypatch, caplog
):
    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    engine = make_engine(tmp_path, "threads", file_size=64 << 10)
    with caplog.at_level(logging.WARNING, logger="swap.files"):
        extent = engine.allocate(10_000)
    assert any("fallocate is not supported" in r.getMessage() for r in caplog.records)
    file = extent.segments[0].file
    assert file.path.stat().st_size == 64 << 10
    buffer = pool.acquire()
    data = random_bytes(10_000, 9)
    fill(buffer, data)
    engine.write_sync(extent, buffer)
    buffer.array[:] = 0
    engine.read_sync(extent, buffer)
    assert torch.equal(contents(buffer, 10_000), data)
