"""The swap engine's queues: requests waiting per drive, and the queue slots in use.

At most ``window`` slots are in use over all drives (the backend's queue depth) and at most
``drive_depth`` per drive; a slot holds a chain of one transfer's contiguous requests (see
``swap.transfer.CHAIN_BYTES``). A slot whose chain holds a request that timed out is stalled:
the kernel still has it, so it stays in use until that request completes. Everything here runs
under the engine's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from swap.transfer import Chain, Piece, Transfer


class DriveQueues:
    """One queue of requests per drive and the slots each drive has in use."""

    def __init__(self, drives: int, window: int, drive_depth: int, chain_length: int) -> None:
        #: queue slots over all drives, and per drive
        self.window = window
        self.drive_depth = drive_depth
        #: requests per slot at most
        self.chain_length = chain_length
        self._queues: list[deque[Piece]] = [deque() for _ in range(drives)]
        #: requests queued over all drives
        self.queued = 0
        self._slots = 0  # queue slots in use (chains in flight), over all drives
        self._drive_slots = [0] * drives
        self._stalled = 0  # slots held by a chain with a request that timed out
        self._drive_stalled = [0] * drives
        self._next_queue = 0  # round robin over the drive queues

    @property
    def slots_in_use(self) -> int:
        """Queue slots in use (chains in flight), over all drives."""
        return self._slots

    def add(self, piece: Piece, first: bool = False) -> None:
        """Queues ``piece`` on its drive (``first``: ahead of the others, a transfer under
        way's remainder)."""
        drive_queue = self._queues[piece.file.drive]
        if first:
            drive_queue.appendleft(piece)
        else:
            drive_queue.append(piece)
        self.queued += 1

    def take(self) -> list[Piece] | None:
        """The next chain to submit: round robin over drives with a free queue slot."""
        if self._slots >= self.window:
            return None
        count = len(self._queues)
        for step in range(count):
            drive = (self._next_queue + step) % count
            drive_queue = self._queues[drive]
            if drive_queue and self._drive_slots[drive] < self.drive_depth:
                self._next_queue = (drive + 1) % count
                free = min(self.window - self._slots, self.drive_depth - self._drive_slots[drive])
                # What is queued is spread over the free slots first (a small transfer's requests
                # all run at once); chains grow only once there is more than slots.
                length = min(self.chain_length, -(-len(drive_queue) // free))
                chain = [drive_queue.popleft()]
                while (
                    len(chain) < length and drive_queue and chain[-1].continued_by(drive_queue[0])
                ):
                    chain.append(drive_queue.popleft())
                self.queued -= len(chain)
                return chain
        return None

    def occupy(self, chain: Chain) -> None:
        """``chain`` takes a slot of its drive."""
        self._slots += 1
        self._drive_slots[chain.drive] += 1

    def release(self, chain: Chain) -> None:
        """``chain``'s requests are all done: its slot is free."""
        self._slots -= 1
        self._drive_slots[chain.drive] -= 1
        if chain.stalled:
            self._stalled -= 1
            self._drive_stalled[chain.drive] -= 1

    def stall(self, chain: Chain) -> None:
        """A request of ``chain`` timed out: its slot stays in use until the request completes."""
        if not chain.stalled:
            chain.stalled = True
            self._stalled += 1
            self._drive_stalled[chain.drive] += 1

    def drop(self, transfer: Transfer) -> None:
        """Removes ``transfer``'s queued requests."""
        for drive_queue in self._queues:
            kept = [p for p in drive_queue if p.transfer is not transfer]
            if len(kept) != len(drive_queue):
                drive_queue.clear()
                drive_queue.extend(kept)
        self.queued -= transfer.queued

    def hung(self) -> Iterator[tuple[deque[Piece], int]]:
        """The queues nothing will start: every slot of their drive (or every slot of all)
        held by a request that timed out; each with the number of slots hung."""
        stalled_all = self._stalled >= self.window
        for drive, drive_queue in enumerate(self._queues):
            stalled = self._drive_stalled[drive]
            if drive_queue and (stalled_all or stalled >= self.drive_depth):
                yield drive_queue, stalled or self._stalled

    def clear(self) -> None:
        """Drops every queued request."""
        for drive_queue in self._queues:
            drive_queue.clear()
        self.queued = 0

    def recount(self) -> None:
        """Counts the queued requests again (after an interrupted submit took some off)."""
        self.queued = sum(len(drive_queue) for drive_queue in self._queues)
