"""swap.stream_file: pieces written through aligned buffers and read back, and a failed request
raised as a SwapIOError naming the file, the offset and the cause."""

from __future__ import annotations

import errno
from concurrent.futures import Future

import pytest
import torch

from swap.backends.base import IORequest
from swap.errors import SwapIOError
from swap.stream_file import StreamWriter, read_pieces


def _pieces(path, sizes):
    pieces = []
    with StreamWriter(path, buffer_size=1 << 16, buffer_count=2) as writer:
        for i, size in enumerate(sizes):
            pieces.append((writer.write(bytes([i + 1]) * size), size))
    return pieces


def test_pieces_round_trip(tmp_path):
    sizes = [1, 4096, 70_000, 3]
    pieces = _pieces(tmp_path / "f", sizes)
    got = dict(read_pieces(tmp_path / "f", pieces, request_size=1 << 14, depth=2))
    for i, size in enumerate(sizes):
        assert torch.equal(got[i][:size], torch.full((size,), i + 1, dtype=torch.uint8))


def _failing(submit, fail_at: int):
    """``submit`` whose ``fail_at``-th request (0-based) fails with EIO."""
    calls = [0]

    def wrapped(request: IORequest) -> Future:
        calls[0] += 1
        if calls[0] - 1 != fail_at:
            return submit(request)
        future: Future = Future()
        future.set_exception(OSError(errno.EIO, "injected"))
        return future

    return wrapped


def test_a_failed_write_names_the_file_and_the_offset(tmp_path):
    path = tmp_path / "f"
    writer = StreamWriter(path, buffer_size=1 << 16, buffer_count=2)
    writer.backend.submit = _failing(writer.backend.submit, fail_at=1)  # the second buffer
    writer.write(bytes(3 << 16))
    with pytest.raises(SwapIOError) as caught:
        writer.close()
    error = caught.value
    assert (error.op, error.path, error.offset, error.errno) == ("write", path, 1 << 16, errno.EIO)
    assert str(path) in str(error) and "EIO" in str(error)


def test_a_failed_read_names_the_file_and_the_offset(tmp_path, monkeypatch):
    path = tmp_path / "f"
    pieces = _pieces(path, [1 << 16, 1 << 16])
    import swap.stream_file as stream_file

    make = stream_file.make_backend

    def failing_backend(name, depth):
        backend = make(name, depth)
        backend.submit = _failing(backend.submit, fail_at=1)
        return backend

    monkeypatch.setattr(stream_file, "make_backend", failing_backend)
    with pytest.raises(SwapIOError) as caught:
        list(read_pieces(path, pieces, request_size=1 << 16, depth=1))
    error = caught.value
    assert (error.op, error.path, error.offset, error.errno) == ("read", path, 1 << 16, errno.EIO)
