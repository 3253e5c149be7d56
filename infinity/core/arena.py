"""The staging arena's allocator: fixed slots, with small ranges packed inside shared slots.

A contiguous first-fit allocator over the whole arena fragments: small shards (biases, norms)
land between large ones and soon no gap is large enough for a buffer-sized shard, although the
total free space is. Here the arena is ``count`` slots of ``slot_size`` bytes (one swap buffer
each). A range larger than half a slot takes a whole slot; smaller ranges are packed into
"small" slots with a first-fit allocator. Every shard is at most one slot, so a free slot always
fits any shard, and eviction only has to empty one slot.
"""

from __future__ import annotations

from swap import ALIGNMENT, align_up
from swap.files import RangeAllocator as _Ranges


class SlotArena:
    def __init__(self, slot_size: int, count: int) -> None:
        if slot_size % ALIGNMENT or slot_size <= 0 or count <= 0:
            raise ValueError("slot_size must be a positive multiple of 4096 and count >= 1")
        self.slot_size = slot_size
        self.count = count
        self._free_slots = list(range(count - 1, -1, -1))
        self._small: dict[int, _Ranges] = {}

    @property
    def nbytes(self) -> int:
        return self.slot_size * self.count

    def free_slot_offsets(self) -> list[int]:
        """Byte offsets of the slots nothing is placed in."""
        return [slot * self.slot_size for slot in self._free_slots]

    def whole(self, size: int) -> bool:
        return 2 * size > self.slot_size

    def take(self, nbytes: int) -> int | None:
        """A byte offset of an aligned range of ``nbytes``, or None when none is free."""
        size = align_up(max(nbytes, 1))
        if size > self.slot_size:
            raise ValueError(f"{nbytes} bytes do not fit in a {self.slot_size}-byte slot")
        if self.whole(size):
            if not self._free_slots:
                return None
            return self._free_slots.pop() * self.slot_size
        for slot, ranges in self._small.items():
            offset = ranges.take(size)
            if offset is not None:
                return slot * self.slot_size + offset
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        ranges = _Ranges(self.slot_size)
        self._small[slot] = ranges
        offset = ranges.take(size)
        assert offset is not None  # an empty slot holds any range of at most half a slot
        return slot * self.slot_size + offset

    def take_run(self, count: int) -> int | None:
        """The offset of the first free slot followed by ``count - 1`` more free ones, taking
        only that first slot (the next ones are for the shards placed after it), or None."""
        free = set(self._free_slots)
        for slot in sorted(free):
            if all(slot + k in free for k in range(1, count)):
                self._free_slots.remove(slot)
                return slot * self.slot_size
        return None

    def take_slot_at(self, offset: int) -> bool:
        """Takes the whole slot starting at ``offset`` if it is free (a shard placed right
        after the one before it, so that the two are contiguous)."""
        slot, within = divmod(offset, self.slot_size)
        if within or slot >= self.count or slot not in self._free_slots:
            return False
        self._free_slots.remove(slot)
        return True

    def give(self, offset: int, nbytes: int) -> int | None:
        """Frees a range; returns the offset of its slot when the slot is now wholly free."""
        size = align_up(max(nbytes, 1))
        slot, within = divmod(offset, self.slot_size)
        if self.whole(size):
            if within or slot in self._free_slots or slot in self._small:
                raise RuntimeError(f"bad release of slot {slot}")
            self._free_slots.append(slot)
            return slot * self.slot_size
        ranges = self._small[slot]
        ranges.give(within, size)
        if ranges.free_bytes == self.slot_size:
            del self._small[slot]
            self._free_slots.append(slot)
            return slot * self.slot_size
        return None
