"""Reused fp32 scratch for the optimizer's update groups (decoded state, widened masters)."""

from __future__ import annotations

import torch


class DecodeScratch:
    """The fp32 buffers an update group's compressed state is decoded into, one per state key
    of ``capacity`` elements (the largest group's), reused by every group of a step: a fresh
    tensor per group is mapped, faulted in and zeroed by the kernel, three times the conversion
    itself on a 26M-element moment. Released at the end of each optimizer step, so that they
    take no memory in forward; while they live they are the decoded state's transient, which
    the memory plan reserves (two of the largest shard)."""

    def __init__(self, capacity: int, device: str = "cpu") -> None:
        self.capacity = capacity
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._taken: dict[str, int] = {}

    def take(self, key: str, numel: int) -> torch.Tensor | None:
        """``numel`` elements of key's buffer after those taken since the last reset, or None
        where they would not fit (the caller decodes into a new tensor)."""
        start = self._taken.get(key, 0)
        if start + numel > self.capacity:
            return None
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(
                self.capacity, dtype=torch.float32, device=self.device
            )
        self._taken[key] = start + numel
        return buffer[start : start + numel]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def reset(self) -> None:
        """The state decoded since the last reset is no longer used."""
        self._taken.clear()

    def release(self) -> None:
        self._taken.clear()
        self._buffers.clear()
