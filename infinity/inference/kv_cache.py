"""A Hugging Face ``Cache`` whose layers leave the compute device between uses.

``generate(..., cache=cache)`` calls ``cache.update(keys, values, layer)`` once per attention
layer and forward. Here that call takes the layer's earlier K/V back from the tier (host RAM or
NVMe, :mod:`infinity.inference.kv_tiers`), fetched ahead while the previous layer computed,
concatenates the new tokens exactly as ``DynamicCache`` does (so attention sees the same
tensors, and greedy output is the same token for token), writes only the new tokens to the
tier, and starts fetching the next layer (after the last layer, the first one for the next
step). The device then holds at most two layers' K/V: the one computing and the one on its
way, within the configured budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from infinity.errors import BudgetError
from infinity.inference.kv_config import KVOffloadConfig
from infinity.inference.kv_tiers import (
    KV,
    HostKVTier,
    KVTier,
    NvmeKVTier,
    PendingFetch,
    Segments,
    tensor_bytes,
)

log = logging.getLogger(__name__)


@dataclass
class ResidencyCounters:
    """What the device held and how layers came back, since the cache was made."""

    resident_layers_peak: int = 0
    resident_bytes_peak: int = 0
    prefetched: int = 0  # fetches started one layer ahead
    demand_fetches: int = 0  # a layer needed with no fetch under way
    prefetch_skipped: int = 0  # two layers would not fit the budget together
    compactions: int = 0  # layers rewritten whole


class KVResidency:
    """Which layers' K/V are on the device, and the fetches under way; keeps them within the
    budget. The layer computing stays counted until the next layer's update, since attention
    reads it after ``update`` returns."""

    def __init__(self, tier: KVTier, budget: int) -> None:
        self.tier = tier
        self.budget = budget
        self.counters = ResidencyCounters()
        self._pending: dict[int, PendingFetch] = {}
        self._resident: dict[int, int] = {}  # layer -> bytes on the device (or arriving)

    def _note(self) -> None:
        c = self.counters
        c.resident_layers_peak = max(c.resident_layers_peak, len(self._resident))
        c.resident_bytes_peak = max(c.resident_bytes_peak, sum(self._resident.values()))

    def begin(self, layer: int) -> None:
        """``layer`` starts computing: the previous one's K/V are done with."""
        for other in [i for i in self._resident if i != layer and i not in self._pending]:
            del self._resident[other]

    def take(self, layer: int) -> Segments | None:
        """The layer's stored K/V on the device, as segments (None when it holds nothing)."""
        pending = self._pending.pop(layer, None)
        if pending is None:
            if self.tier.segments(layer) == 0:
                return None
            pending = self.tier.fetch(layer)
            self.counters.demand_fetches += 1
        segments = pending.wait()
        self._resident[layer] = pending.nbytes
        self._note()
        return segments

    def computing(self, layer: int, nbytes: int) -> None:
        if nbytes > self.budget:
            raise BudgetError(
                f"kv offload: one layer's K/V take {nbytes} bytes at this batch x context, "
                f"more than the kv budget of {self.budget} bytes: raise the budget to at least "
                f"{2 * nbytes} (two layers, so the next is prefetched) or shorten the batch "
                f"or the context"
            )
        self._resident[layer] = nbytes
        self._note()

    def prefetch(self, layer: int, expected_bytes: int) -> None:
        """Starts fetching ``layer`` if it holds K/V and fits beside what is resident."""
        if layer in self._pending or layer in self._resident or self.tier.segments(layer) == 0:
            return
        if sum(self._resident.values()) + expected_bytes > self.budget:
            self.counters.prefetch_skipped += 1
            return
        self._pending[layer] = self.tier.fetch(layer)
        self._resident[layer] = expected_bytes
        self.counters.prefetched += 1
        self._note()

    def settle(self, abandon: bool = False) -> None:
        """Waits for fetches under way and forgets them (reset, reorder, close). ``abandon``:
        nobody will use them (close), so a failed one is logged rather than raised."""
        pending, self._pending = list(self._pending.items()), {}
        self._resident.clear()
        for layer, fetch in pending:
            try:
                fetch.wait()
            except Exception as exc:
                if not abandon:
                    raise
                log.warning("kv offload: an unused fetch of layer %d failed: %s", layer, exc)


class OffloadedKVLayer(CacheLayerMixin):
    """One attention layer's place in :class:`OffloadedKVCache`: its length and dtype stay
    here, its K/V in the tier. ``keys``/``values`` stay None: nothing outside the cache may
    hold them between forwards."""

    is_sliding = False
    is_croppable = False

    def __init__(self, index: int, owner: OffloadedKVCache) -> None:
        super().__init__()
        self.index = index
        self._owner = owner
        self.seq_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> KV:
        return self._owner.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.seq_length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        """Nothing: the layer is offloaded by the cache after every update."""

    def prefetch(self) -> None:
        """Nothing: the cache prefetches one layer ahead itself."""

    def reset(self) -> None:
        self._owner.drop_layer(self.index)
        self.seq_length = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._owner.transform_layer(self.index, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._owner.transform_layer(self.index, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._owner.transform_layer(self.index, lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "the offloaded KV cache cannot be cropped (assisted decoding): generate without "
            "an assistant model, or with the default cache"
        )


class OffloadedKVCache(Cache):
    """A ``Cache`` for ``generate(..., cache=...)`` whose layers wait in host RAM or on NVMe
    and come back one layer ahead of use. Make one per ``generate`` call (as with
    ``DynamicCache``) and ``close`` it after, or use it as a context manager.
    ``stats()`` counts the bytes written and read and what was resident."""

    def __init__(self, config: KVOffloadConfig, device: torch.device | str = "cpu") -> None:
        super().__init__(layers=[])
        self.config = config
        self.device = torch.device(device)
        tier: KVTier
        if config.target == "nvme":
            assert config.nvme_path is not None  # KVOffloadConfig checked it
            tier = NvmeKVTier(
                self.device, config.nvme_path, config.budget, config.aio, config.verify_checksums
            )
        else:
            tier = HostKVTier(self.device)
        self.tier = tier
        self.residency = KVResidency(tier, config.budget)
        self._closed = False
        self._layer_count = 0  # attention layers, once a forward has gone through them all

    # -- what generate and the attention layers call --------------------------------------

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> KV:
        if self._closed:
            raise RuntimeError("this offloaded KV cache is closed: make a new one per generate")
        while len(self.layers) <= layer_idx:
            self.layers.append(OffloadedKVLayer(len(self.layers), self))
        layer = self.layers[layer_idx]
        assert isinstance(layer, OffloadedKVLayer)
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        residency = self.residency
        residency.begin(layer_idx)
        # One concatenation of the stored segments and the new tokens (with none stored, a
        # copy of the states, as DynamicCache makes).
        stored = residency.take(layer_idx) or []
        keys = torch.cat([*(k for k, _ in stored), key_states], dim=-2)
        values = torch.cat([*(v for _, v in stored), value_states], dim=-2)
        del stored
        residency.computing(layer_idx, tensor_bytes(keys) + tensor_bytes(values))
        self._store(layer_idx, keys, values, key_states, value_states)
        layer.seq_length = keys.shape[-2]
        self._prefetch_after(layer_idx, key_states.shape[-2])
        return keys, values

    def _store(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
    ) -> None:
        tier = self.tier
        capacity = tier.fetch_capacity()
        segments = tier.segments(layer)
        whole = segments == 0 or segments >= self.config.max_segments
        if not whole and capacity is not None:
            whole = tier.span_after_append(layer, new_keys, new_values) > capacity
        if whole:
            if segments:
                self.residency.counters.compactions += 1
            tier.replace(layer, keys, values)
        else:
            tier.append(layer, new_keys, new_values)

    def _prefetch_after(self, layer_idx: int, new_tokens: int) -> None:
        if layer_idx == 0 and len(self.layers) > 1:
            self._layer_count = len(self.layers)  # the second forward: all layers are known
        following_idx = layer_idx + 1
        if self._layer_count:
            following_idx %= self._layer_count  # the last layer fetches the next step's first
        if following_idx >= len(self.layers) or following_idx == layer_idx:
            return
        following = self.layers[following_idx]
        assert isinstance(following, OffloadedKVLayer)
        if following.seq_length == 0:
            return
        stored = self.tier.layer_bytes(following.index)
        # its bytes once this step's tokens are added: the fetch lands, then grows by them
        expected = stored * (following.seq_length + new_tokens) // following.seq_length
        self.residency.prefetch(following.index, expected)

    # -- beam search and resets ------------------------------------------------------------

    def transform_layer(self, layer: int, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Applies ``change`` to the layer's keys and values (beam reordering, batch edits)."""
        self.residency.settle()
        stored = self.residency.take(layer)
        if stored is None:
            return
        keys = change(torch.cat([k for k, _ in stored], dim=-2))
        values = change(torch.cat([v for _, v in stored], dim=-2))
        self.tier.replace(layer, keys, values)
        self.residency.settle()

    def drop_layer(self, layer: int) -> None:
        self.residency.settle()
        self.tier.drop(layer)

    # -- reporting and closing -------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Bytes written to and read from the tier, transfers, what the device held at most,
        how layers came back, and the bytes the tier holds now."""
        tier, residency = self.tier.counters, self.residency.counters
        return {
            "kv_bytes_written": tier.bytes_written,
            "kv_bytes_read": tier.bytes_read,
            "kv_writes": tier.writes,
            "kv_reads": tier.reads,
            "kv_stored_bytes": self.tier.stored_bytes(),
            "kv_resident_layers_peak": residency.resident_layers_peak,
            "kv_resident_bytes_peak": residency.resident_bytes_peak,
            "kv_prefetched": residency.prefetched,
            "kv_demand_fetches": residency.demand_fetches,
            "kv_prefetch_skipped": residency.prefetch_skipped,
            "kv_compactions": residency.compactions,
            "kv_budget": self.config.budget,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.residency.settle(abandon=True)
        finally:
            self.tier.close()

    def __enter__(self) -> OffloadedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            log.debug("offloaded KV cache garbage-collected without close(); closing it")
            self.close()
