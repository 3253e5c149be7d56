"""What the framework integrations share: finding a model's store, checking that a model and an
optimizer are the ones attached, and exporting a model without gathering it into one process."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infinity.core.lifecycle import store_of
from infinity.errors import AttachError
from infinity.store import TieredStore

log = logging.getLogger(__name__)

#: the store's checkpoint inside a framework's checkpoint directory
CHECKPOINT_DIR = "infinity"


def attached_store(model: nn.Module | None, framework: str) -> TieredStore | None:
    """The open store ``model`` is attached to, after checking that every parameter of the
    model is attached (a parameter added after attach, such as peft's LoRA weights added by
    ``get_peft_model`` on an attached model, would never be trained)."""
    if model is None:
        return None
    store = store_of(model)
    if store is None:
        return None
    registry = store.registry
    if registry.entries:  # a store that only reports leaves the parameters as they are
        loose = [name for name, p in model.named_parameters() if registry.entry_of(p) is None]
        if loose:
            raise AttachError(
                f"{framework}: parameters {loose[:3]} of the model are not attached to its "
                f"TieredStore (added after attach, e.g. by peft.get_peft_model on an attached "
                f"model): build the whole model, adapters included, then attach it"
            )
    return store


def check_optimizer(store: TieredStore, optimizer: Any, framework: str) -> None:
    """Refuses an optimizer that is not the one ``attach`` returned: one built over the
    attached parameters after attach would try to write them in place."""
    if optimizer is None or optimizer is store.optimizer:
        return
    inner = getattr(optimizer, "optimizer", None)  # a framework's wrapper (accelerate's)
    if inner is not None and inner is store.optimizer:
        return
    raise AttachError(
        f"{framework}: the optimizer given is not the one store.attach(model, optimizer) "
        f"returned. Build the optimizer over model.parameters() before attach, pass it to "
        f"attach, and give the framework the optimizer attach returns"
    )


def is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def export_pretrained(store: TieredStore, out: str | Path, dtype: str = "fp32") -> list[Path]:
    """Writes the attached model's weights to ``out`` as Hugging Face safetensors (with its
    config), loadable with ``from_pretrained``: every rank saves its share into a store
    checkpoint under ``out``, then the first rank assembles one output file at a time from it;
    the checkpoint is removed after. Call on every rank."""
    from infinity.checkpointing.export import export_checkpoint

    out = Path(out)
    staging = out / ".infinity-export"
    store.save_checkpoint(staging)
    written: list[Path] = []
    try:
        if is_main_process():
            written = export_checkpoint(staging, out, dtype=dtype)
        barrier()
    finally:
        if is_main_process():
            shutil.rmtree(staging, ignore_errors=True)
    return written


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters' current values by name (an adapter's weights), read on every
    rank in the same order: across ranks each read assembles the parameter from every rank."""
    return {
        name: param.detach().clone().cpu()
        for name, param in model.named_parameters()
        if param.requires_grad
    }
