"""``state_dict`` and ``load_state_dict`` on an attached model.

Between uses a parameter holds an empty placeholder, so the default ``state_dict`` would save
empty tensors. A post-hook on each module replaces its parameters' entries with their real
values (read from wherever they live). Loading pops the module's parameter keys before the
default loader sees them (it would compare them against the placeholder's shape), checks them
the way the default loader does, writes the values into the shards (host copy, then NVMe), and a
post-hook on the same module removes those keys from ``missing_keys``.

Every name of a parameter counts: a Parameter registered twice in one module (``m.alias =
m.weight``) has two keys, as in torch, so the hooks walk names with ``remove_duplicate=False``.

Errors are reported as torch reports them (appended to ``error_msgs``, so ``load_state_dict``
raises its usual "Error(s) in loading state_dict for ..." with the same lines, and the valid
keys are still loaded, as torch loads them). ``assign=True`` copies the values too: the store
must keep the Parameter objects it registered, so they are never replaced.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infinity.core.overwrite import write_entry

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


log = logging.getLogger(__name__)


def _own_params(module: nn.Module):
    # Every name, even a second name of the same Parameter: torch saves and loads both keys.
    return module.named_parameters(recurse=False, remove_duplicate=False)


def install_state_dict_hooks(store: AttachedStore, model: nn.Module) -> list[Any]:
    registry = store.registry
    #: keys written by a module's pre-hook in the load under way, removed from missing_keys by
    #: the same module's post-hook (which torch runs even when load_state_dict was called on a
    #: submodule, unlike a hook on the root alone)
    loaded: set[str] = set()
    handles = []

    def save_hook(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        for name, param in _own_params(module):
            entry = registry.entry_of(param)
            key = prefix + name
            if entry is not None and key in state_dict:
                store.stepping.loop_acted("model.state_dict()")
                state_dict[key] = store.materialize(entry)

    def load_pre_hook(
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        for name, param in _own_params(module):
            entry = registry.entry_of(param)
            key = prefix + name
            # A key left over from a load that raised must not hide a missing key now.
            loaded.discard(key)
            if entry is None or key not in state_dict:
                continue  # the default loader reports it missing
            value = state_dict.pop(key)
            # From here on the key is ours: the default loader would report it missing (it was
            # popped), so the post-hook takes it off that list whether or not it loaded.
            loaded.add(key)
            # The same checks, in the same words, as Module._load_from_state_dict.
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append(
                    f'While copying the parameter named "{key}", expected torch.Tensor or '
                    f"Tensor-like object from checkpoint but received {type(value)}"
                )
                continue
            if len(entry.shape) == 0 and len(value.shape) == 1 and value.shape[0] == 1:
                value = value[0]  # torch's backward compatibility for 0.3 checkpoints
            if value.shape != entry.shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from "
                    f"checkpoint, the shape in current model is {entry.shape}."
                )
                continue
            try:
                flat = value.detach().to(device="cpu", dtype=entry.values_dtype).reshape(-1)
            except Exception as ex:
                error_msgs.append(
                    f'While copying the parameter named "{key}", whose dimensions in the model '
                    f"are {entry.shape} and whose dimensions in the checkpoint are "
                    f"{value.size()}, an exception occurred : {ex.args}."
                )
                continue
            write_entry(store, entry, flat)

    def load_post_hook(module: nn.Module, incompatible: Any) -> None:
        if not loaded:
            return
        mine = {key for key in incompatible.missing_keys if key in loaded}
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in mine]
        loaded.difference_update(mine)

    for module in model.modules():
        if any(registry.entry_of(p) is not None for _, p in _own_params(module)):
            handles.append(module.register_state_dict_post_hook(save_hook))
            handles.append(module.register_load_state_dict_pre_hook(load_pre_hook))
            handles.append(module.register_load_state_dict_post_hook(load_post_hook))
    return handles
