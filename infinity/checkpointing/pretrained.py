"""Pretrained Hugging Face weights (safetensors) streamed into an attached model's shards.

The point of offloading is a model larger than host memory, so the weights never exist in memory
whole: each parameter is read from its file shard by shard, each shard's flat range of it with
one positioned read into a buffer reused from shard to shard
(:mod:`infinity.checkpointing.safetensors_file`: not a memory map, whose touched pages would stay
in the process's resident set), converted to the masters' dtype and written through the tiers
like any checkpoint load; the tensors are read in the order they lie in the file. The process
grows by about the largest shard's bytes in the file's dtype, whatever the checkpoint's size.
Safetensors files hold raw bytes and a JSON header, so loading one runs no code. Build the model
with its parameters on the meta device (``accelerate.init_empty_weights`` or
``torch.device("meta")`` for a model without buffers), attach, then load: modules without
``reset_parameters`` stay without values until this fills them.

Keys are the model's own names (``model.named_parameters()``, every alias of a tied weight
included); what a checkpoint lacks and what it has in excess are reported as
``load_state_dict`` reports them, and a tied weight is read once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.modules.module import _IncompatibleKeys

from infinity.checkpointing.safetensors_file import ReadBuffer, SafetensorsFile
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
    reads = ReadBuffer()
    for file in checkpoint_files(path):
        with SafetensorsFile(file) as tensors:
            unexpected += sorted(
                k for k in tensors.tensors if k not in entries and k not in buffers
            )
            for key in sorted(tensors.tensors, key=lambda k: tensors.tensors[k].offset):
                entry = entries.get(key)
                if entry is None and key not in buffers:
                    continue
                seen.add(key)
                info = tensors.tensors[key]
                if entry is None:
                    _check_shape(file, key, info.shape, tuple(buffers[key].shape))
                    with torch.no_grad():
                        value = tensors.read(key, 0, info.numel, reads)
                        buffers[key].copy_(value.reshape(info.shape))
                elif entry.index not in loaded:  # a tied weight is read once
                    _check_shape(file, key, info.shape, tuple(entry.shape))
                    _stream(store, entry, tensors, key, reads)
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


def _check_shape(file: Path, key: str, shape: tuple[int, ...], model: tuple[int, ...]) -> None:
    if shape != model:
        raise CheckpointError(
            f"{file.name}: {key} has shape {shape}, the model's {model}: this checkpoint is "
            "for another model"
        )


def _stream(
    store: AttachedStore, entry: ParamEntry, tensors: SafetensorsFile, key: str, reads: ReadBuffer
) -> None:
    """``key``'s values into ``entry``, each shard's flat range read on its own."""

    def piece(shard: Shard) -> torch.Tensor:
        if not shard.real_numel:  # this rank's slice is all padding
            return torch.empty(0)
        return tensors.read(key, shard.start, shard.real_numel, reads)  # this rank's slice

    write_entry_pieces(store, entry, piece)
