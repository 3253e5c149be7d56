"""Pretrained Hugging Face weights (safetensors) streamed into an attached model's shards.

The point of offloading is a model larger than host memory, so the weights never exist in memory
whole: each parameter is read from its file shard by shard (safetensors slices along the first
dimension, memory-mapped), converted to the masters' dtype and written through the tiers like
any checkpoint load. Safetensors files hold raw bytes and a JSON header, so loading one runs no
code. Build the model with its parameters on the meta device (``accelerate.init_empty_weights``
or ``torch.device("meta")`` for a model without buffers), attach, then load: modules without
``reset_parameters`` stay without values until this fills them.

Keys are the model's own names (``model.named_parameters()``, every alias of a tied weight
included); what a checkpoint lacks and what it has in excess are reported as
``load_state_dict`` reports them, and a tied weight is read once.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

from infinity.core.overwrite import write_entry_pieces
from infinity.core.shards import ParamEntry, Shard
from infinity.errors import CheckpointError

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``path`` itself, or a directory's index or its
    single ``model.safetensors``."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(
            f"pretrained checkpoint {path} does not exist: pass a .safetensors "
            f"file or a directory holding {SINGLE_NAME} or {INDEX_NAME}"
        )
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {exc}"
            ) from exc
        files = []
        for name in dict.fromkeys(weight_map.values()):
            file = (path / name).resolve()
            if file.parent != path.resolve() or not file.is_file():
                raise CheckpointError(f"{index} names {name!r}, which is not a file in {path}")
            files.append(file)
        return files
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    raise CheckpointError(f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}")


def load_pretrained(store: AttachedStore, path: Path) -> _IncompatibleKeys:
    """See the module docstring. Returns ``(missing_keys, unexpected_keys)``."""
    from safetensors import safe_open

    model = store.model
    assert model is not None  # TieredStore.load_pretrained checks it is attached
    registry = store.registry
    entries = {
        name: registry.entry_of(param)
        for name, param in model.named_parameters(remove_duplicate=False)
    }
    buffers = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                buffers[f"{module_name}.{name}" if module_name else name] = buffer
    loaded: set[int] = set()
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                entry = entries.get(key)
                if entry is None and key not in buffers:
                    unexpected.append(key)
                    continue
                seen.add(key)
                if entry is None:
                    with torch.no_grad():
                        buffers[key].copy_(handle.get_tensor(key))
                elif entry.index not in loaded:  # a tied weight is read once
                    _stream(store, entry, handle.get_slice(key), key, file)
                    loaded.add(entry.index)
    missing = [
        name for name, entry in entries.items() if entry is not None and entry.index not in loaded
    ]
    missing += [name for name in buffers if name not in seen]
    if missing or unexpected:
        log.warning(
            "load_pretrained(%s): %d missing keys (e.g. %s), %d unexpected (e.g. %s)",
            path,
            len(missing),
            missing[:3],
            len(unexpected),
            unexpected[:3],
        )
    return _IncompatibleKeys(missing, unexpected)


def _stream(store: AttachedStore, entry: ParamEntry, view: Any, key: str, file: Path) -> None:
    shape = tuple(view.get_shape())
    if shape != tuple(entry.shape):
        raise CheckpointError(
            f"{file.name}: {key} has shape {shape}, the model's parameter "
            f"{tuple(entry.shape)}: this checkpoint is for another model"
        )
    if not shape:
        value = view[:]
        write_entry_pieces(store, entry, lambda shard: shard.part_of(value.reshape(-1)))
        return
    row = math.prod(shape[1:])  # elements per first-dimension index

    def piece(shard: Shard) -> torch.Tensor:
        if not shard.real_numel:  # this rank's slice is all padding
            return torch.empty(0)
        first = shard.start // row
        last = -(-(shard.start + shard.real_numel) // row)
        rows = view[first:last].reshape(-1)  # one shard's worth (and up to a row each side)
        offset = shard.start - first * row
        return rows[offset : offset + shard.real_numel]

    write_entry_pieces(store, entry, piece)
