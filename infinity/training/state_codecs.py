"""Optimizer state kept in fewer bytes between steps (``precision.optimizer_state_dtype``).

With the optimizer state on NVMe every step reads each per-element state tensor (Adam's two
moments: 8 bytes per parameter in fp32) and writes it back. A codec stores those tensors in a
companion of fewer bytes and converts on the way in and out of the update: the optimizer itself
still runs on fp32 tensors (torch's fused AdamW wants state in the parameter's dtype), decoded
just before it and encoded right after, one group of shards at a time so that the decoded
copies stay a transient of about two of the largest shard.

* ``bf16``: 2 bytes per element, rounded stochastically. Rounded to nearest, a second moment
  with ``beta2=0.999`` would never decay: its per-step change (0.1%) is below half a bf16 step
  (0.2-0.4%). Stochastic rounding keeps each value right in expectation.
* ``int8``: 1 byte per element plus an fp32 scale per block of 2048 (1.002 bytes), as 8-bit
  Adam does: each block is divided by its largest magnitude, and each element becomes an 8-bit
  code on a logarithmic scale, so small values keep their relative precision where a linear
  code would zero them. A code is the float's exponent and its top three mantissa bits: steps
  of 1/8 to 1/16 of the value. Signed state (momentum) has a sign bit and 127 levels over 16
  octaves below the block's largest magnitude (smaller values are zero); non-negative state
  (``exp_avg_sq`` and the other keys in :data:`NON_NEGATIVE_KEYS`) has 255 levels over 32
  octaves, and a value below them codes as the smallest level, never as zero: a second moment
  decoded too small would divide the update by almost nothing. Codes are rounded
  stochastically, for the reason above.

Stochastic rounding takes its random bits from a table of noise each codec makes once from a
generator of its own, read at an offset per chunk drawn from the seed the caller passes to
``encode`` and from nothing else: the optimizer seeds each encode from the shard's id, the state
key and the step count, so the noise a shard's state gets does not depend on which encodes ran
before it in this process (the order of a step's updates follows the arena; a resumed store has
run none), and a resumed run rounds as the uninterrupted one does. torch's global generator is
never touched (the user's seed stays the user's), and the cost is one integer addition per
element. ``encode`` without a seed rounds to nearest instead: loads (checkpoints, state dicts)
hold the decoded values of codes, and rounding them to nearest gives those codes back exactly,
where noise would move about one in ten million to its neighbour (``decode`` multiplies by the
block's scale, ``encode`` divides, and the quotient can miss the code's value by an ulp).
Everything else is torch operations into buffers made once per thread, chunk by chunk, so that
converting allocates no memory the size of the state (under a host budget a large allocation is
a fresh mapping, every page of it faulted). The planner's meta tensors are converted to meta
tensors without work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

# the stored sizes are the budgets' too (core): re-exported for the codecs' users
from infinity.core.state_sizes import INT8_BLOCK as INT8_BLOCK
from infinity.core.state_sizes import stored_nbytes as stored_nbytes

#: per-element state known to be non-negative (second moments and accumulators of squares):
#: int8 codes them without a sign, over more octaves
NON_NEGATIVE_KEYS = frozenset(
    {"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"}
)
#: elements converted at a time (a multiple of the int8 block)
CHUNK = 1 << 20
#: a float32's bits shifted right by this keep its exponent and top three mantissa bits
_CODE_SHIFT = 20
#: (bits of 1.0) >> _CODE_SHIFT: the code of a block's largest magnitude, before the offset
_ONE = 0x3F800000 >> _CODE_SHIFT
#: noise values the tables hold beyond a chunk: the span of the random offsets
_NOISE_SPAN = 1 << 16


class StateCodec(Protocol):
    """How per-element optimizer state is stored between steps."""

    #: the config's name (``precision.optimizer_state_dtype``)
    name: str

    def stored(self, numel: int) -> tuple[int, torch.dtype]:
        """The companion's element count and dtype for ``numel`` elements of state."""
        ...

    def encode(self, values: torch.Tensor, out: torch.Tensor, key: str, seed: int | None) -> None:
        """Stores ``values`` (fp32, flat) into ``out`` (the companion's host copy, flat),
        rounded stochastically with the noise of ``seed``, or to nearest without one."""
        ...

    def decode(
        self, stored: torch.Tensor, numel: int, key: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The fp32 values ``stored`` holds, flat, ``numel`` of them: written into ``out``
        (fp32, flat, ``numel`` elements) and returned, or without it into a new tensor."""
        ...

    def kernel_noise(self, seed: int, numel: int) -> tuple[torch.Tensor, list[int]]:
        """What ``encode`` with ``seed`` adds to ``numel`` elements, for the fused kernel
        (infinity.training.fused_adam): the noise table and the offset of each chunk."""
        ...


class _Noise:
    """Integers uniform in [low, high), read at offsets drawn from each encode's seed (see the
    module docstring), and per-thread scratch buffers of a chunk."""

    def __init__(self, low: int, high: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._table = torch.randint(
            low, high, (CHUNK + _NOISE_SPAN,), generator=generator, dtype=torch.int32
        )
        #: added in place of the noise to round to nearest: half of the bits cut off
        self.half = high // 2
        self._local = threading.local()

    @staticmethod
    def offsets(seed: int | None, numel: int) -> list[int | None]:
        """One offset into the table per chunk of ``numel`` elements, drawn from ``seed``
        alone (a generator of the call's own: encodes on several threads draw nothing shared);
        None for each chunk without a seed (rounding to nearest)."""
        chunks = -(-numel // CHUNK)
        if seed is None:
            return [None] * chunks
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(_NOISE_SPAN, (chunks,), generator=generator).tolist()

    def kernel_noise(self, seed: int, numel: int) -> tuple[torch.Tensor, list[int]]:
        """The table and the offsets of ``seed``'s chunks of ``numel`` elements: what an encode
        with ``seed`` adds, as the fused kernel reads it."""
        return self._table, [o for o in self.offsets(seed, numel) if o is not None]

    def take(self, n: int, offset: int | None) -> torch.Tensor | int:
        """What an encode adds to ``n`` elements' bits: the noise at ``offset``, or without
        one half of what the rounding cuts off (to nearest)."""
        if offset is None:
            return self.half
        return self._table[offset : offset + n]

    def scratch(self, n: int, which: int) -> torch.Tensor:
        """A per-thread int32 buffer (``which``: 0, 1 or 2) of ``n`` elements at most a chunk."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = [torch.empty(CHUNK, dtype=torch.int32) for _ in "abc"]
        return buffers[which][:n]


class Bf16Codec:
    """2 bytes per element, rounded stochastically (see the module docstring)."""

    name = "bf16"

    def __init__(self, seed: int = 0) -> None:
        # Up to one bf16 step below its last bit: cutting the low bits off afterwards rounds
        # stochastically.
        self._noise = _Noise(0, 1 << 16, seed)

    def stored(self, numel: int) -> tuple[int, torch.dtype]:
        return numel, torch.bfloat16

    def kernel_noise(self, seed: int, numel: int) -> tuple[torch.Tensor, list[int]]:
        return self._noise.kernel_noise(seed, numel)

    def encode(self, values: torch.Tensor, out: torch.Tensor, key: str, seed: int | None) -> None:
        if values.device.type == "meta":
            return
        bits = values.view(torch.int32)
        offsets = self._noise.offsets(seed, values.numel())
        for start, offset in zip(range(0, values.numel(), CHUNK), offsets):
            part = bits[start : start + CHUNK]
            noisy = self._noise.scratch(part.numel(), 0)
            # On sign and magnitude, adding to the low bits moves the magnitude, either sign;
            # zero stays zero and infinities infinite.
            torch.add(part, self._noise.take(part.numel(), offset), out=noisy)
            noisy.bitwise_and_(-(1 << 16))
            out[start : start + CHUNK].copy_(noisy.view(torch.float32))  # exact

    def decode(
        self, stored: torch.Tensor, numel: int, key: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=stored.device)
        if stored.device.type != "meta":
            out.copy_(stored[:numel])
        return out


class Int8Codec:
    """Blockwise 8-bit codes on a logarithmic scale with an fp32 scale per block (see the
    module docstring). The companion is bytes: the blocks' scales first (4-byte aligned at the
    start of its slot), then one code per element."""

    name = "int8"

    def __init__(self, seed: int = 0) -> None:
        self.block = INT8_BLOCK
        # Up to one code step: the shift then rounds down, so the code is rounded stochastically.
        self._noise = _Noise(0, 1 << _CODE_SHIFT, seed)

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def stored(self, numel: int) -> tuple[int, torch.dtype]:
        return 4 * self.blocks(numel) + numel, torch.uint8

    def kernel_noise(self, seed: int, numel: int) -> tuple[torch.Tensor, list[int]]:
        return self._noise.kernel_noise(seed, numel)

    def parts(self, stored: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales (fp32, one per block) and the codes (uint8) in a companion's bytes."""
        head = 4 * self.blocks(numel)
        return stored[:head].view(torch.float32), stored[head : head + numel]

    @staticmethod
    def levels(key: str) -> tuple[int, bool]:
        """(the top code, whether the state is non-negative) for state ``key``: the top code
        stands for a block's largest magnitude, code 1 for the smallest level, 0 for zero."""
        if key in NON_NEGATIVE_KEYS:
            return 255, True
        return 127, False

    def encode(self, values: torch.Tensor, out: torch.Tensor, key: str, seed: int | None) -> None:
        if values.device.type == "meta":
            return
        numel = values.numel()
        scales, codes = self.parts(out, numel)
        top, non_negative = self.levels(key)
        noise = self._noise
        for start, offset in zip(range(0, numel, CHUNK), noise.offsets(seed, numel)):
            part = values[start : start + CHUNK]
            n = part.numel()
            first = start // self.block
            magnitude = noise.scratch(n, 0).view(torch.float32)
            torch.abs(part, out=magnitude)
            scale = scales[first : first + self.blocks(n)]
            self._block_max(magnitude, scale)
            self._per_block(magnitude, scale, lambda block, s: block.div_(s.clamp_min(1e-38)))
            code = magnitude.view(torch.int32)
            code.add_(noise.take(n, offset)).bitwise_right_shift_(_CODE_SHIFT).sub_(_ONE - top)
            if non_negative:
                # Below the smallest level is the smallest level; only zero is zero.
                nonzero = noise.scratch(n, 1)
                torch.ne(part, 0, out=nonzero)
                code.clamp_(1, top).mul_(nonzero)
            else:
                code.clamp_(0, top)
                sign = noise.scratch(n, 1)
                torch.bitwise_right_shift(part.view(torch.int32), 24, out=sign)
                code.bitwise_or_(sign.bitwise_and_(128))
            codes[start : start + n].copy_(code)

    def _block_max(self, magnitude: torch.Tensor, scale: torch.Tensor) -> None:
        n = magnitude.numel()
        whole = n // self.block
        if whole:
            torch.amax(
                magnitude[: whole * self.block].view(whole, self.block), 1, out=scale[:whole]
            )
        if whole * self.block < n:
            scale[whole:].copy_(magnitude[whole * self.block :].amax().reshape(1))

    def _per_block(
        self,
        values: torch.Tensor,
        scale: torch.Tensor,
        apply: Callable[[torch.Tensor, torch.Tensor], object],
    ) -> None:
        """``apply(block_view, its_scale_column)`` over the whole blocks, then the last one."""
        n = values.numel()
        whole = n // self.block
        if whole:
            apply(values[: whole * self.block].view(whole, self.block), scale[:whole, None])
        if whole * self.block < n:
            apply(values[whole * self.block :], scale[whole:])

    def decode(
        self, stored: torch.Tensor, numel: int, key: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(numel, dtype=torch.float32, device=stored.device)
        if stored.device.type == "meta":
            return out
        scales, codes = self.parts(stored, numel)
        top, non_negative = self.levels(key)
        noise = self._noise
        for start in range(0, numel, CHUNK):
            n = min(CHUNK, numel - start)
            first = start // self.block
            bits = noise.scratch(n, 0)
            bits.copy_(codes[start : start + n])
            sign = None
            if not non_negative:
                # The sign goes back onto the float's sign bit after the magnitude.
                sign = noise.scratch(n, 2)
                torch.bitwise_and(bits, 128, out=sign)
                bits.bitwise_and_(127)
            keep = noise.scratch(n, 1)
            torch.clamp(bits, max=1, out=keep)  # 0 for a zero code, else 1
            bits.add_(_ONE - top).bitwise_left_shift_(_CODE_SHIFT).mul_(keep)
            value = bits.view(torch.float32)
            self._per_block(value, scales[first : first + self.blocks(n)], lambda b, s: b.mul_(s))
            if sign is not None:
                bits.bitwise_or_(sign.bitwise_left_shift_(24))
            out[start : start + n].copy_(value)
        return out


def codec_for(name: str, seed: int = 0) -> StateCodec | None:
    """The codec for ``precision.optimizer_state_dtype`` (None: fp32, stored as it is)."""
    if name == "fp32":
        return None
    if name == "bf16":
        return Bf16Codec(seed)
    if name == "int8":
        return Int8Codec(seed)
    raise ValueError(f"unknown optimizer state dtype {name!r}")
