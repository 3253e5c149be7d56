"""A checkpoint out as consolidated Hugging Face safetensors: each parameter whole, in its own
shape and the chosen dtype, files of at most ``max_shard_size`` bytes with the index file when
there are several, and the model's ``config.json`` beside them when the checkpoint has one, so
``from_pretrained(out)`` loads it.

The output is written one file at a time: each parameter is assembled from its chunks (whatever
number of ranks saved it), so peak memory is about one output file, never the model.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from infinity.checkpointing.checkpoint import STATE_NAME
from infinity.checkpointing.storage import ChunkReader, read_metadata_document
from infinity.errors import CheckpointError

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INDEX_NAME = "model.safetensors.index.json"


def export_checkpoint(
    checkpoint: Path, out: Path, dtype: str = "fp32", max_shard_size: int = 5 * 10**9
) -> list[Path]:
    """Writes the checkpoint's parameters to ``out`` as safetensors; returns the files."""
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    document = read_metadata_document(checkpoint)
    try:
        state = json.loads((checkpoint / STATE_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint / STATE_NAME} cannot be read: {exc}") from exc
    target = DTYPES[dtype]
    params = state["params"]
    # Files first: each parameter goes into the current file unless it would overflow it.
    files: list[list[str]] = [[]]
    size = 0
    for name, info in params.items():
        nbytes = math.prod(info["shape"]) * target.itemsize
        if files[-1] and size + nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    reader = ChunkReader(checkpoint, document)
    names = (
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        if len(files) > 1
        else ["model.safetensors"]
    )
    weight_map: dict[str, str] = {}
    total = 0
    written = []
    for file_name, members in zip(names, files):
        tensors = {}
        for name in members:
            tensors[name] = _assemble(reader, document, name, params[name]["shape"]).to(target)
            total += tensors[name].numel() * target.itemsize
            weight_map[name] = file_name
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        written.append(out / file_name)
        log.info("wrote %s (%d tensors)", out / file_name, len(members))
        del tensors
    if len(files) > 1:
        (out / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        written.append(out / INDEX_NAME)
    if (checkpoint / "config.json").exists():
        shutil.copyfile(checkpoint / "config.json", out / "config.json")
        written.append(out / "config.json")
    return written


def _assemble(reader: ChunkReader, document: dict, name: str, shape: list[int]) -> torch.Tensor:
    key = f"param/{name}"
    info = document["tensors"].get(key)
    if info is None:
        raise CheckpointError(f"the checkpoint has no values for {name}")
    numel = math.prod(shape)
    flat = torch.empty(numel, dtype=getattr(torch, info["dtype"]))
    covered = 0
    for chunk in info["chunks"]:
        (offset,), (length,) = chunk["offsets"], chunk["sizes"]
        flat[offset : offset + length].copy_(reader.chunk(key, chunk["offsets"]).reshape(-1))
        covered += length
    if covered != numel:
        raise CheckpointError(
            f"the checkpoint's chunks cover {covered} of the {numel} elements "
            f"of {name}: it is incomplete"
        )
    return flat.view(shape)
