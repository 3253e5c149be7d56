"""Inference helpers: the KV cache of Hugging Face ``generate`` offloaded to host RAM or NVMe.

``offloaded_kv_cache`` (or ``store.kv_cache``) makes the cache; transformers is imported only
then, so ``infinity`` imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from infinity.inference.kv_config import KV_TARGETS, KVOffloadConfig

if TYPE_CHECKING:
    from infinity.inference.kv_cache import OffloadedKVCache

__all__ = ["KV_TARGETS", "KVOffloadConfig", "offloaded_kv_cache"]


def offloaded_kv_cache(
    config: KVOffloadConfig | None = None, *, device: torch.device | str = "cpu", **options: Any
) -> OffloadedKVCache:
    """A cache for ``model.generate(..., cache=cache)`` whose layers wait in host RAM or on NVMe
    between uses; ``options`` are :class:`KVOffloadConfig` fields (``target``, ``budget``,
    ``nvme_path``...), checked strictly, used when ``config`` is not given. One cache per
    ``generate`` call; close it after (it is a context manager)."""
    if config is None:
        config = KVOffloadConfig.from_dict(options)
    elif options:
        raise TypeError("pass either a KVOffloadConfig or its fields as keywords, not both")
    from infinity.inference.kv_cache import OffloadedKVCache

    return OffloadedKVCache(config, device)
