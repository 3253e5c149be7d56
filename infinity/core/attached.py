"""The tiered store as the parts it attaches see it: one typed interface instead of ``Any``.

The hooks, the wrapped optimizer and its step, parameter access, state dicts, pretrained loads,
checkpoints, activation offload, reporting and the planner each get the store they belong to.
:class:`AttachedStore` is everything they may use of it: its parts and settings (read-only) and
the calls they make into it. :class:`~infinity.store.TieredStore` satisfies it (a type
checker verifies that wherever the store hands itself over), and nothing else of the store is
theirs to reach.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from infinity.config import OffloadConfig
    from infinity.core.budgets import MemoryPlan
    from infinity.core.placement import Placement
    from infinity.core.shards import ParamEntry, Shard, ShardRegistry
    from infinity.core.timeline import Timeline
    from infinity.core.trace import TraceFollower
    from infinity.ranks.partition import Partition
    from infinity.training.activations import ActivationOffload
    from infinity.training.hooks import HookSet
    from infinity.training.optimizer import OffloadedOptimizer
    from infinity.training.param_access import ParamAccess
    from infinity.training.precision import LossScaler
    from infinity.training.stepping import Stepping
    from infinity.training.update_timing import UpdateTiming
    from swap import SwapEngine


class AttachedStore(Protocol):
    """What the parts of an attached store use of it (see the module docstring). The parts
    that exist only once a model is attached are None before."""

    # -- settings and parts (read-only) ---------------------------------------------------------
    @property
    def config(self) -> OffloadConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def registry(self) -> ShardRegistry: ...

    @property
    def follower(self) -> TraceFollower: ...

    @property
    def timeline(self) -> Timeline: ...

    @property
    def stepping(self) -> Stepping: ...

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def placement(self) -> Placement | None: ...

    @property
    def partition(self) -> Partition | None: ...

    @property
    def engine(self) -> SwapEngine | None: ...

    @property
    def optimizer(self) -> OffloadedOptimizer | None: ...

    @property
    def hooks(self) -> HookSet | None: ...

    @property
    def access(self) -> ParamAccess | None: ...

    @property
    def activations(self) -> ActivationOffload | None: ...

    @property
    def update_timing(self) -> UpdateTiming | None: ...

    @property
    def scaler(self) -> LossScaler | None: ...

    @property
    def budgets(self) -> dict[str, int]: ...

    @property
    def memory_plan(self) -> MemoryPlan | None: ...

    @property
    def master_tier(self) -> str: ...

    @property
    def pipeline_step(self) -> bool: ...

    # -- calls into the store ---------------------------------------------------------------------
    def materialize(self, entry: ParamEntry) -> torch.Tensor: ...

    def stats(self) -> dict[str, Any]: ...

    def watch_heap(self) -> None: ...

    def after_step(self, optimizer: OffloadedOptimizer, first: bool) -> None: ...

    def before_state_change(self, shards: Iterable[Shard]) -> None: ...

    def checkpoint_progress(self) -> None: ...

    def wait_for_checkpoint(self) -> None: ...
