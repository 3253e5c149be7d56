"""The extent allocator: first fit, reuse, coalescing, double frees, accounting, striping."""

from __future__ import annotations

import random

import pytest

from swap import ALIGNMENT, SwapSpace
from swap.files import RangeAllocator

PAGE = ALIGNMENT


@pytest.fixture
def space(tmp_path):
    s = SwapSpace([tmp_path], direct=False, file_size=16 * PAGE)
    yield s
    s.close()


def test_free_then_reuse_and_coalesce(space):
    a = space.allocate(PAGE)
    b = space.allocate(2 * PAGE - 100)  # rounds up to 2 pages
    c = space.allocate(PAGE)
    assert [e.segments[0].offset for e in (a, b, c)] == [0, PAGE, 3 * PAGE]
    assert space.allocated_bytes == 4 * PAGE
    space.free(b)
    assert space.allocated_bytes == 2 * PAGE
    d = space.allocate(2 * PAGE)  # first fit: b's hole
    assert d.segments[0].offset == PAGE and d.segments[0].file is b.segments[0].file
    for extent in (a, d, c):
        space.free(extent)
    assert space.allocated_bytes == 0
    # everything coalesced back into one range: the whole file fits again, no new file
    whole = space.allocate(16 * PAGE)
    assert whole.segments[0].offset == 0 and len(space.files) == 1
    assert whole.segments[0].length == whole.segments[0].file.capacity


def test_double_free_raises_and_stale_extent_cannot_free_new_owner(space):
    a = space.allocate(PAGE)
    space.free(a)
    with pytest.raises(ValueError, match="double free"):
        space.free(a)
    b = space.allocate(PAGE)  # same bytes as a
    assert b.segments == a.segments and b != a
    with pytest.raises(ValueError, match="double free"):
        space.free(a)
    assert space.allocated_bytes == PAGE  # b untouched
    space.free(b)


def test_extent_of_another_space_is_refused(space, tmp_path):
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = SwapSpace([other_dir], direct=False, file_size=16 * PAGE)
    try:
        foreign = other.allocate(PAGE)
        mine = space.allocate(PAGE)
        assert foreign.serial == mine.serial  # serials alone would not tell them apart
        with pytest.raises(ValueError):
            space.free(foreign)
        with pytest.raises(ValueError):
            space.check_extent(foreign)
        space.check_extent(mine)
    finally:
        other.close()


def test_allocated_bytes_accounting_and_new_files(space):
    extents = [space.allocate(n) for n in (1, PAGE, PAGE + 1, 5 * PAGE, 7 * PAGE)]
    assert space.allocated_bytes == PAGE + PAGE + 2 * PAGE + 5 * PAGE + 7 * PAGE
    assert space.file_bytes == 16 * PAGE
    more = space.allocate(3 * PAGE)  # 16 pages used: a second file
    assert len(space.files) == 2 and space.file_bytes == 32 * PAGE
    big = space.allocate(40 * PAGE)  # larger than file_size: a file of exactly its size
    assert big.segments[0].file.capacity == 40 * PAGE
    assert space.allocated_bytes == 16 * PAGE + 3 * PAGE + 40 * PAGE
    for extent in extents + [more, big]:
        space.free(extent)
    assert space.allocated_bytes == 0


def test_zero_and_negative_sizes(space):
    empty = space.allocate(0)
    assert empty.nbytes == 0 and empty.capacity == PAGE
    with pytest.raises(ValueError):
        space.allocate(-1)
    space.free(empty)


def test_free_list_coalesces_in_any_order():
    rng = random.Random(5)
    free = RangeAllocator(64 * PAGE)
    taken = [free.take(PAGE) for _ in range(64)]
    assert taken == [i * PAGE for i in range(64)] and free.take(PAGE) is None
    rng.shuffle(taken)
    for start in taken:
        free.give(start, PAGE)
    assert free.starts == [0] and free.lengths == [64 * PAGE]
    with pytest.raises(ValueError, match="double free"):
        free.give(5 * PAGE, PAGE)  # inside the free range
    free.take(10 * PAGE)
    with pytest.raises(ValueError, match="double free"):
        free.give(9 * PAGE, 2 * PAGE)  # overlaps the free range that starts at 10 pages


def test_can_take_answers_as_takes_in_that_order_would():
    free = RangeAllocator(8 * PAGE)
    held = [free.take(PAGE) for _ in range(8)]
    for start in (held[1], held[2], held[4], held[5], held[6]):
        free.give(start, PAGE)  # free: 2 pages at 1, 3 pages at 4
    assert free.can_take([3 * PAGE, 2 * PAGE])
    assert free.can_take([2 * PAGE, 3 * PAGE])
    assert free.can_take([PAGE, PAGE, 2 * PAGE])  # first fit: both in the 2-page hole
    assert not free.can_take([PAGE, 2 * PAGE, 2 * PAGE])  # 5 pages free, first fit splits them
    assert not free.can_take([4 * PAGE])
    assert free.can_take([])
    assert free.starts == [PAGE, 4 * PAGE] and free.lengths == [2 * PAGE, 3 * PAGE]  # unchanged
    assert [free.take(n) for n in (3 * PAGE, 2 * PAGE)] == [4 * PAGE, PAGE]


def test_small_extents_rotate_over_directories(tmp_path):
    dirs = [tmp_path / n for n in "ab"]
    for d in dirs:
        d.mkdir()
    s = SwapSpace(dirs, direct=False, file_size=16 * PAGE, stripe_size=4 * PAGE)
    try:
        roots = [s.allocate(PAGE).segments[0].file.path.parent.parent for _ in range(4)]
        assert roots == [dirs[0], dirs[1], dirs[0], dirs[1]]
    finally:
        s.close()


@pytest.mark.parametrize("count", [2, 3])
def test_striped_extents_map_every_byte_once(tmp_path, count):
    dirs = [tmp_path / str(i) for i in range(count)]
    for d in dirs:
        d.mkdir()
    stripe = 2 * PAGE
    s = SwapSpace(dirs, direct=False, file_size=64 * PAGE, stripe_size=stripe)
    try:
        for nbytes in (stripe + 1, 2 * stripe, 3 * stripe + 5, 11 * stripe - 1, 20 * stripe):
            extent = s.allocate(nbytes)
            padded = -(-nbytes // PAGE) * PAGE
            owned = {id(seg.file): seg for seg in extent.segments}
            assert len(owned) == len(extent.segments)  # one member per directory
            used = set()
            position = 0
            for file, file_offset, ext_offset, length in extent.locate(0, padded):
                assert ext_offset == position  # pieces are in order and leave no gap
                position += length
                seg = owned[id(file)]
                assert seg.offset <= file_offset and file_offset + length <= seg.offset + seg.length
                assert length <= stripe and (file_offset - seg.offset) % stripe + length <= stripe
                span = {(id(file), o) for o in range(file_offset, file_offset + length, PAGE)}
                assert not span & used  # no byte of a file serves two extent offsets
                used |= span
            assert position == padded
            # a sub-range maps onto the same places as the whole
            sub = extent.locate(stripe, padded - stripe)
            whole = [p for p in extent.locate(0, padded) if p[2] >= stripe]
            assert [(id(f), o, e, n) for f, o, e, n in sub] == [
                (id(f), o, e, n) for f, o, e, n in whole
            ]
    finally:
        s.close()


def test_free_after_close_is_ignored(tmp_path):
    s = SwapSpace([tmp_path], direct=False, file_size=4 * PAGE)
    extent = s.allocate(PAGE)
    s.close()
    s.free(extent)
    with pytest.raises(RuntimeError, match="closed"):
        s.allocate(PAGE)
