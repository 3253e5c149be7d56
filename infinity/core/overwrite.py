"""Overwriting a parameter's values in every tier it lives in: loads (state dicts, checkpoints,
pretrained weights), writes through parameter access, the planner's starting values and attach's
re-initialised parameters all replace values this way, through the store's placement."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infinity.core.residency import Residency as R
from infinity.core.shards import ParamEntry, Shard

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


def write_entry(store: AttachedStore, entry: ParamEntry, value: torch.Tensor) -> None:
    """Overwrites a parameter's values in every tier it lives in."""
    flat = value.detach().reshape(-1).to(entry.values_dtype)
    write_entry_pieces(store, entry, shard_part(flat))


def shard_part(flat: torch.Tensor) -> Callable[[Shard], torch.Tensor]:
    """``piece_of`` for :func:`write_entry_pieces` from a whole flat value."""
    return lambda shard: shard.part_of(flat)


def write_entry_pieces(
    store: AttachedStore, entry: ParamEntry, piece_of: Callable[[Shard], torch.Tensor]
) -> None:
    """Overwrites a parameter's values shard by shard, each from ``piece_of(shard)`` (its
    flat range, any dtype), so a caller reading from a file holds one shard's worth at a
    time."""
    placement = store.placement
    assert placement is not None  # an attached store's parameter
    placement.drop_device(entry, force=True)
    store.before_state_change(entry.shards)  # a checkpoint being saved copies them first
    for shard in entry.shards:
        piece = piece_of(shard).reshape(-1)
        if shard.quant is None:  # a quantized one is encoded from its values as they come
            piece = piece.to(shard.dtype)
        # The whole value is replaced: no need to read the old one (which may be the very
        # corrupted or stale extent a checkpoint load is healing).
        placement.prepare_overwrite(shard)
        if shard.state is R.HOST_STORING:
            placement.reap(shard, wait=True)
        shard.fill_from(piece)
        store.registry.set_state(shard, R.HOST)
        shard.version += 1
        if placement.nvme:
            placement.store_async(shard)
            placement.refresh_compute_copy(shard, write_back=True)
    placement.mark_initialised(entry)
    if entry.index in placement.persistent:
        placement.gather(entry, hold=False)
