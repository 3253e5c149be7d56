"""The wrapped optimizer's parameters between steps: ``p.grad`` answers with the shard's gradient.

The optimizer's ``param_groups`` hold one host parameter per shard (its "step parameter"), bound
to the shard's values and gradient only while a step updates it. Frameworks and loops that clip
"the optimizer's parameters" (Lightning's and Fabric's ``clip_gradients``, which take
``optimizer.param_groups``) read ``p.grad`` of those between steps, where an ordinary placeholder
has none: ``clip_grad_norm_`` would return 0 and clip nothing. So between steps each step
parameter is an instance of a subclass of ``nn.Parameter`` whose ``__torch_function__`` answers
``p.grad`` with a :class:`~infinity.training.grad_view.GradView` of its shard's gradient (norms from
the per-shard norms, across ranks; scaling and zeroing recorded), and runs everything else as
plain torch. While a step updates it, it is a plain ``nn.Parameter`` again, so the optimizer's
own kernels see no ``__torch_function__``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infinity.core.shards import Shard
from infinity.training.grad_view import GradView
from infinity.training.op_kinds import name_of, run_plain

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


class StepParams:
    """The step parameters' idle class (``p.grad`` answers), and the switch to plain for updates."""

    def __init__(
        self,
        store: AttachedStore,
        shards: Iterable[Shard],
        shape_of: Callable[[Shard], torch.Size],
    ) -> None:
        self.store = store
        #: a shard's step shape (the bound step parameter's)
        self._shape_of = shape_of
        self._shards = list(shards)
        #: id of a step parameter -> its shard
        self._shard_of: dict[int, Shard] = {id(s.step_param): s for s in self._shards}
        self._plain = False
        owner = self

        def torch_function(
            cls: type, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            return owner._handle(func, args, kwargs or {})

        self.idle_class: type = type(
            "IdleStepParameter",
            (nn.Parameter,),
            {"__torch_function__": classmethod(torch_function), "__module__": __name__},
        )
        self._idle()

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """Every step parameter plain for the block (an update: the optimizer asks each one for
        its ``grad`` and skips those without); idle again after. Nested blocks cost nothing."""
        if self._plain:
            yield
            return
        self._plain = True
        for shard in self._shards:
            shard.step_param.__class__ = nn.Parameter
        try:
            yield
        finally:
            self._idle()
            self._plain = False

    def _idle(self) -> None:
        for shard in self._shards:
            shard.step_param.__class__ = self.idle_class

    def _handle(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if args and name_of(func) == "grad.__get__":
            shard = self._shard_of.get(id(args[0]))
            access, placement = self.store.access, self.store.placement
            if shard is not None and access is not None and not access.closed:
                assert placement is not None  # made before any access
                if placement.gradients.has_grad(shard):
                    return GradView(access, shard.entry, shard, self._shape_of(shard))
                return None
        return run_plain(func, args, kwargs)
