"""``state_dict`` and ``load_state_dict`` on an attached model.

Between uses a parameter holds an empty placeholder, so the default ``state_dict`` would save
empty tensors. A post-hook on each module replaces its parameters' entries with their real
values (read from wherever they live). Loading pops the module's parameter keys before the
default loader sees them, writes the values into the shards (host copy, then NVMe), and a
post-hook on the root removes those keys from ``missing_keys``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from infinity.residency import Residency as R

log = logging.getLogger(__name__)


def install_state_dict_hooks(store: Any, model: nn.Module) -> list[Any]:
    registry = store.registry
    loaded: set[str] = set()
    handles = []

    def save_hook(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        for name, param in module.named_parameters(recurse=False):
            entry = registry.entry_of(param)
            key = prefix + name
            if entry is not None and key in state_dict:
                state_dict[key] = store.materialize(entry)

    def load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for name, param in module.named_parameters(recurse=False):
            entry = registry.entry_of(param)
            key = prefix + name
            if entry is None or key not in state_dict:
                continue
            value = state_dict.pop(key)
            if not isinstance(value, torch.Tensor) or value.shape != entry.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise RuntimeError(f"size mismatch for {key}: copying a param with shape {shape} "
                                   f"from checkpoint, the shape in current model is "
                                   f"{tuple(entry.shape)}")
            write_entry(store, entry, value)
            loaded.add(key)

    def load_post_hook(module: nn.Module, incompatible: Any) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in loaded]
        loaded.clear()

    for module in model.modules():
        if any(registry.entry_of(p) is not None for p in module.parameters(recurse=False)):
            handles.append(module.register_state_dict_post_hook(save_hook))
            handles.append(module.register_load_state_dict_pre_hook(load_pre_hook))
    handles.append(model.register_load_state_dict_post_hook(load_post_hook))
    return handles


def write_entry(store: Any, entry: Any, value: torch.Tensor) -> None:
    """Overwrites a parameter's values in every tier it lives in."""
    placement = store.placement
    placement.drop_device(entry)
    flat = value.detach().reshape(-1).to(entry.dtype)
    for shard in entry.shards:
        placement.ensure_host(shard)
        if shard.state is R.HOST_STORING:
            placement.reap(shard, wait=True)
        shard.host.copy_(flat[shard.start:shard.start + shard.numel])
        store.registry.set_state(shard, R.HOST)
        shard.version += 1
        if placement.nvme:
            placement.store_async(shard)
