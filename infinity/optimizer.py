"""The optimizer the store hands back: the user's own optimizer class, run on host masters.

Each shard gets a host ``nn.Parameter`` (its "step parameter") that the user's optimizer class
updates. Between steps the step parameter holds an empty placeholder; during a step it is pointed
at the shard's host copy and its host gradient, in tiles that fit the staging arena when the
shards live on NVMe: the next tile is read while the current one is updated, and each updated
tile is written back behind. Optimizers skip parameters whose ``grad`` is None, so running the
step once per tile updates exactly that tile.

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are
the inner optimizer's own objects, so LR schedulers and code that edits ``param_groups`` work.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from infinity.errors import AttachError
from infinity.shards import Shard

log = logging.getLogger(__name__)


def _empty(shard: Shard) -> torch.Tensor:
    return torch.empty(0, dtype=shard.dtype)


class OffloadedOptimizer(Optimizer):
    """See the module docstring. Build it with :meth:`wrap`."""

    def __init__(self, store: Any, inner: Optimizer, shards: list[Shard]) -> None:
        # Optimizer.__init__ would rebuild param_groups; share the inner optimizer's instead.
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self.store = store
        self.inner = inner
        self.shards = shards
        self.state = inner.state
        self.param_groups = inner.param_groups

    @classmethod
    def wrap(cls, store: Any, optimizer: Optimizer) -> "OffloadedOptimizer":
        registry = store.registry
        groups = []
        shards: list[Shard] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                entry = registry.entry_of(param)
                if entry is None:
                    raise AttachError("the optimizer holds a parameter that is not part of the "
                                      "attached model: build the optimizer from "
                                      "model.parameters()")
                if id(param) in seen:
                    continue
                seen.add(id(param))
                for shard in entry.shards:
                    # Some optimizers (Adagrad) create state in their constructor with
                    # full_like(param): a zero-stride view has the right shape and costs nothing,
                    # while full_like of it still allocates a real, dense tensor.
                    shape = _step_shape(shard)
                    shard.step_param = torch.nn.Parameter(
                        torch.zeros((), dtype=shard.dtype).expand(shape),
                        requires_grad=entry.requires_grad)
                    params.append(shard.step_param)
                    shards.append(shard)
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": params, **settings})
        inner = _construct_like(optimizer, groups)
        _migrate_state(optimizer, inner, registry)
        for shard in shards:
            shard.step_param.data = _empty(shard)
        return cls(store, inner, shards)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.store._run_step(self)
        return loss

    def update(self, tile: list[Shard]) -> None:
        """Runs the inner optimizer over ``tile``, whose host copies and grads are in place."""
        for shard in tile:
            view = shard.host.view(_step_shape(shard))
            shard.step_param.data = view
            grad = shard.grad
            shard.step_param.grad = grad.view_as(view) if grad is not None else None
        try:
            self.inner.step()
        finally:
            for shard in tile:
                shard.step_param.grad = None
                shard.step_param.data = _empty(shard)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.store.placement.clear_grads(set_to_none)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.state = self.inner.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add parameter groups before attach: the store must shard "
                                  "every parameter it updates")

    def __repr__(self) -> str:
        return f"Offloaded({self.inner!r})"


def _construct_like(optimizer: Optimizer, groups: list[dict[str, Any]]) -> Optimizer:
    cls = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)
    except TypeError:
        # Custom optimizers whose defaults are not all constructor arguments: every group
        # carries its settings, so the constructor's own defaults are overridden anyway.
        return cls(groups)


def _step_shape(shard: Shard) -> torch.Size:
    """A whole parameter keeps its shape (optimizers like Adafactor depend on it); a piece of
    one is a flat range."""
    entry = shard.entry
    return entry.shape if len(entry.shards) == 1 else torch.Size([shard.numel])


def _migrate_state(optimizer: Optimizer, inner: Optimizer, registry: Any) -> None:
    """Carries state the user's optimizer already has (it stepped, or its constructor made
    some) over to the step parameters: per-element tensors are split like the parameter,
    everything else (``step`` counters, scalars) is copied."""
    for param, state in optimizer.state.items():
        entry = registry.entry_of(param)
        if entry is None or not state:
            continue
        for shard in entry.shards:
            moved = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == entry.shape:
                    piece = value.detach().reshape(-1)[shard.start:shard.start + shard.numel]
                    moved[key] = piece.to("cpu").clone().view(_step_shape(shard))
                elif isinstance(value, torch.Tensor):
                    moved[key] = value.detach().to("cpu").clone()
                else:
                    moved[key] = value
            inner.state[shard.step_param] = moved
