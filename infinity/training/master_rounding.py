"""bf16 masters (``precision.master_dtype='bf16'``): updates in fp32, rounded back stochastically.

A bf16 weight has 8 bits of mantissa: an Adam update of 1e-5 on a weight of 1.0 is 1/780 of its
spacing (2**-7), and rounding to nearest drops it every step, so a plain bf16 master stops
learning once its updates fall below half a spacing. Rounding stochastically (up with the odds of
the distance to the lower neighbour) keeps every update in expectation: over many steps the
weight moves as the fp32 master would, with noise of at most one spacing.

Each update widens the shard's bf16 master (and its bf16 gradient) into fp32 scratch, lets the
user's optimizer run on that, and rounds the result back into the master. The rounding adds a
uniform 16-bit integer to the fp32 value's bits and keeps the upper half: the carry rounds the
magnitude up with exactly the dropped fraction's odds (sign and magnitude are separate, so this
is unbiased for negative values too; inf and nan stay what they are).

The noise costs no draw per element: a draw per element (torch's generator) took five times the
fused AdamW update itself. It is read from a table holding a random permutation of the 65536
16-bit values, repeated along the largest shard: an update reads it from an offset drawn for the
shard and the step. Each element's noise is then exactly uniform, and independent from one step
to the next (the offsets are); elements 65536 apart share their noise within a step, which
correlates nothing that matters (their fractions differ). The table is made once by a generator
of this object, and the offsets come from the shard's id and the step count, never from the
global random streams: a run repeats bit for bit, a resumed run follows the uninterrupted one
(the step count is in the checkpoint), and the user's own draws are untouched.
"""

from __future__ import annotations

import random
import zlib

import torch

from infinity.training.scratch import DecodeScratch

#: the masters this rounds: kept in bf16, updated in fp32
ROUNDED_DTYPE = torch.bfloat16
UPDATE_DTYPE = torch.float32
_LOW_HALF = 1 << 16
#: the seed of the noise table (any fixed value: the table is part of the format of a run)
_TABLE_SEED = 0x5EED


class StochasticMasters:
    """Widens bf16 masters and their gradients for an update, and rounds the results back.

    Scratch for one update group of at most ``capacity`` elements (the largest shard's), reused
    by every group of a step (a :class:`~infinity.training.scratch.DecodeScratch`): the
    master and the gradient in fp32, the carry in int32 over an fp32 buffer; and the noise table
    (int32, ``capacity`` + 65536 elements), made at the first rounding of a step."""

    def __init__(self, capacity: int, device: str = "cpu") -> None:
        self.capacity = capacity
        self.device = device
        self._table: torch.Tensor | None = None
        self._permutation: torch.Tensor | None = None
        self._scratch = DecodeScratch(capacity, device)

    @staticmethod
    def applies(dtype: torch.dtype) -> bool:
        """Whether a master of ``dtype`` is updated through this object."""
        return dtype == ROUNDED_DTYPE

    def widen(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` (bf16) as a new fp32 tensor of the same shape, in this group's scratch."""
        wide = self._take(key, values.numel()).view(values.shape)
        if self.device != "meta":
            wide.copy_(values)
        return wide

    def round_into(self, master: torch.Tensor, updated: torch.Tensor, seed: int) -> None:
        """Rounds ``updated`` (fp32) stochastically into ``master`` (bf16, same elements), with
        the noise of ``seed``."""
        if self.device == "meta":
            return
        numel = updated.numel()
        offset = self.offset(seed)
        carry = self._take("carry", numel).view(torch.int32)
        torch.add(updated.reshape(-1).view(torch.int32), self._noise(offset, numel), out=carry)
        carry.bitwise_right_shift_(16)  # the upper half: a bf16's bits
        master.reshape(-1).view(torch.int16).copy_(carry)

    def _noise(self, offset: int, numel: int) -> torch.Tensor:
        """``numel`` uniform values in [0, 65536) as int32 from the table, starting at
        ``offset``; beyond the table (a group larger than the largest shard), its own."""
        if numel > self.capacity:
            generator = torch.Generator().manual_seed(offset)
            return torch.randint(0, _LOW_HALF, (numel,), dtype=torch.int32, generator=generator)
        if self._table is None:
            repeats = -(-(self.capacity + _LOW_HALF) // _LOW_HALF)
            self._table = self.permutation().repeat(repeats)
        return self._table[offset : offset + numel]

    def permutation(self) -> torch.Tensor:
        """The 65536 noise values (int32) in the table's order: element ``i`` of an update
        at ``offset`` gets value ``(offset + i) % 65536``."""
        if self._permutation is None:
            generator = torch.Generator().manual_seed(_TABLE_SEED)
            self._permutation = torch.randperm(_LOW_HALF, generator=generator).to(torch.int32)
        return self._permutation

    @staticmethod
    def offset(seed: int) -> int:
        """Where in the noise an update with ``seed`` starts."""
        return random.Random(seed).randrange(_LOW_HALF)

    def reset(self) -> None:
        """The group's scratch is no longer used: the next group reuses it."""
        self._scratch.reset()

    def release(self) -> None:
        """Frees the scratch and the table (the end of a step: forward does not hold them)."""
        self._scratch.release()
        self._table = None
        self._permutation = None

    @property
    def nbytes(self) -> int:
        """Bytes the scratch and the table hold now."""
        table = self._table.numel() * self._table.element_size() if self._table is not None else 0
        return self._scratch.nbytes + table

    def _take(self, key: str, numel: int) -> torch.Tensor:
        """``numel`` fp32 elements of ``key``'s scratch (a group larger than the largest
        shard: its own)."""
        taken = self._scratch.take(key, numel)
        if taken is None:
            return torch.empty(numel, dtype=UPDATE_DTYPE, device=self.device)
        return taken


def rounding_seed(shard_id: str, step: int) -> int:
    """The noise's seed for ``shard_id``'s update at optimizer step ``step`` (a state key's,
    when the optimizer encodes compressed state, is ``<shard id>/<key>``): stable across
    processes and runs (crc32, not Python's salted hash)."""
    return (zlib.crc32(shard_id.encode()) << 32) ^ (step * 0x9E3779B97F4A7C15 & (1 << 63) - 1)
