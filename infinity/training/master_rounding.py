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

The noise comes from a generator of this object, seeded per update from the shard's id and the
step count, never from the global random streams: a run repeats bit for bit, a resumed run
follows the uninterrupted one (the step count is in the checkpoint), and the user's own draws
are untouched.
"""

from __future__ import annotations

import zlib

import torch

#: the masters this rounds: kept in bf16, updated in fp32
ROUNDED_DTYPE = torch.bfloat16
UPDATE_DTYPE = torch.float32
_LOW_HALF = 1 << 16


class StochasticMasters:
    """Widens bf16 masters and their gradients for an update, and rounds the results back.

    Scratch for one update group of at most ``capacity`` elements (the largest shard's), reused
    by every group of a step: the master and the gradient in fp32, the noise in int32."""

    def __init__(self, capacity: int, device: str = "cpu") -> None:
        self.capacity = capacity
        self.device = device
        self._generator = torch.Generator(device="cpu")
        self._scratch: dict[str, torch.Tensor] = {}
        self._taken: dict[str, int] = {}

    @staticmethod
    def applies(dtype: torch.dtype) -> bool:
        """Whether a master of ``dtype`` is updated through this object."""
        return dtype == ROUNDED_DTYPE

    def widen(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` (bf16) as a new fp32 tensor of the same shape, in this group's scratch."""
        wide = self._take(key, values.numel(), UPDATE_DTYPE).view(values.shape)
        if self.device != "meta":
            wide.copy_(values)
        return wide

    def round_into(self, master: torch.Tensor, updated: torch.Tensor, seed: int) -> None:
        """Rounds ``updated`` (fp32) stochastically into ``master`` (bf16, same elements), with
        the noise of ``seed``."""
        if self.device == "meta":
            return
        numel = updated.numel()
        self._generator.manual_seed(seed)
        carry = self._take("noise", numel, torch.int32)
        carry.random_(0, _LOW_HALF, generator=self._generator)
        carry.add_(updated.reshape(-1).view(torch.int32))
        carry.bitwise_right_shift_(16)  # the upper half: a bf16's bits
        master.reshape(-1).view(torch.int16).copy_(carry)

    def reset(self) -> None:
        """The group's scratch is no longer used: the next group reuses it."""
        self._taken.clear()

    def release(self) -> None:
        """Frees the scratch (the end of a step: forward does not hold it)."""
        self._taken.clear()
        self._scratch.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the scratch holds now."""
        return sum(t.numel() * t.element_size() for t in self._scratch.values())

    def _take(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = self._taken.get(key, 0)
        if start + numel > self.capacity:  # a group larger than the largest shard: its own
            return torch.empty(numel, dtype=dtype, device=self.device)
        buffer = self._scratch.get(key)
        if buffer is None:
            buffer = torch.empty(self.capacity, dtype=dtype, device=self.device)
            self._scratch[key] = buffer
        self._taken[key] = start + numel
        return buffer[start : start + numel]


def rounding_seed(shard_id: str, step: int) -> int:
    """The noise's seed for ``shard_id``'s update at optimizer step ``step`` (a state key's,
    when the optimizer encodes compressed state, is ``<shard id>/<key>``): stable across
    processes and runs (crc32, not Python's salted hash)."""
    return (zlib.crc32(shard_id.encode()) << 32) ^ (step * 0x9E3779B97F4A7C15 & (1 << 63) - 1)
