"""What ``TieredStore.close`` decides and gives back: the room the parameters may take when
'auto' hands them back, and the handing back itself (infinity.core.handback)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from infinity.config import OffloadConfig
from infinity.core import handback
from infinity.core.budgets import MemoryPlan
from infinity.core.placement import Placement
from infinity.core.shards import ParamEntry, ShardRegistry

log = logging.getLogger("infinity.store")


def restore_room(
    device: torch.device, config: OffloadConfig, plan: MemoryPlan | None
) -> tuple[int, str]:
    """The bytes of parameters 'auto' hands back at close, and what bounds them."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + (plan.device if plan is not None else 0), "the device's free memory"
    if config.host_budget is not None:
        return config.host_budget, "host_budget"
    tiers = (plan.arena + plan.device) if plan is not None else 0
    return psutil.virtual_memory().available // 2 + tiers, "half the memory available"


def choose(
    choice: bool | str | Iterable[Any],
    model: nn.Module,
    registry: ShardRegistry,
    placement: Placement,
    device: torch.device,
    config: OffloadConfig,
    plan: MemoryPlan | None,
) -> tuple[set[int], handback.Declined | None]:
    """The indices of the entries ``close`` gives back for ``choice`` (``restore_params``), and
    what 'auto' declined as too large (infinity.core.handback)."""
    partition = placement.partition
    return handback.choose(
        choice,
        registry=registry,
        uninitialised=placement.uninitialised,
        model=model,
        room=lambda: restore_room(device, config, plan),
        refuse_too_large=config.host_budget is not None,
        agree=partition.min_across if partition is not None and not partition.failed else None,
    )


def restore(
    chosen: set[int],
    *,
    model: nn.Module,
    registry: ShardRegistry,
    placement: Placement,
    device: torch.device,
    materialize: Callable[[ParamEntry], torch.Tensor],
    partitioned: bool,
    declined: handback.Declined | None,
    last_checkpoint: tuple[Path, int] | None,
    steps: int,
    keep_swap_files: bool,
) -> BaseException | None:
    """Gives the ``chosen`` entries their values back, the others initialised go to the
    meta device (infinity.core.handback); returns the first failure. ``declined``: what
    'auto' found too large to give back, said in a warning with where the values are."""
    left, failure = handback.hand_back(
        chosen,
        registry=registry,
        placement=placement,
        device=device,
        materialize=materialize,
        same_order_everywhere=partitioned,
    )
    handback.leave_on_meta(model, left)
    if declined is not None:
        log.warning(
            "close: the parameters (%d bytes) are more than %s (%d bytes) leaves to hand "
            "them back, so restore_params='auto' left them on the meta device. Their "
            "values are %s",
            declined.nbytes,
            declined.what,
            declined.room,
            handback.where_values_are(last_checkpoint, steps, keep_swap_files),
        )
    return failure
