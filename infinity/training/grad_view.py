"""``p.grad`` of an attached parameter: a view of the gradient the store holds, wherever its
bytes are (a host tensor, an arena slot, an NVMe extent).

After backward the gradient has left the parameter (the hooks moved it into the store), so
``p.grad`` answers with a :class:`GradView`: a tensor subclass with the parameter's shape and
device, the masters' dtype (fp32 under bf16/fp16 compute) and no storage of its own, which serves
what training loops do with gradients from what the store already has, without reading the gradient
back:

* the 2-norm (``torch.linalg.vector_norm``, ``Tensor.norm``, ``torch._foreach_norm``, and so
  ``torch.nn.utils.get_total_norm`` and ``clip_grad_norm_``) from the per-shard squared norms
  the gradient hook keeps (turned on the first time a loop asks, so that step alone reads the
  gradients back once);
* ``mul_``/``div_`` by a scalar (``clip_grad_norm_``'s clip factor) and ``zero_()`` are
  recorded per shard and applied where the optimizer step reads the gradient;
* any other in-place op (``clamp_`` of ``clip_grad_value_``, ``p.grad[mask] = 0``) reads the
  gradient, applies the op and stores the result as the gradient;
* any other read (``print``, ``torch.isfinite``, ``.clone()``, ``.view(-1)``) gets the values,
  read through the tiers; views of them are :class:`~infinity.training.op_kinds.Snapshot` tensors.

A view belongs to the gradient of one backward: once ``optimizer.step()`` consumed it or
``zero_grad()`` cleared it, using the view raises instead of answering with another gradient's
values. Assigning ``p.grad`` (``None``, a tensor) drops or replaces the store's gradient.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from infinity.errors import ParameterAccessError
from infinity.training.op_kinds import (
    conversion_is_noop,
    intercepted,
    mark_snapshots,
    substitute,
    tensors_in,
    written,
)

if TYPE_CHECKING:
    from infinity.core.shards import ParamEntry, Shard
    from infinity.training.gradients import Gradients
    from infinity.training.param_access import ParamAccess

log = logging.getLogger(__name__)

_NORMS = frozenset({"linalg_vector_norm", "linalg_norm", "norm"})
_SCALES = {"mul_": False, "div_": True, "_foreach_mul_": False, "_foreach_div_": True}
_ZEROS = frozenset({"zero_", "_foreach_zero_"})


class GradView(torch.Tensor):
    """See the module docstring. Made by an attached parameter's ``.grad``."""

    _infinity_access: ParamAccess
    _infinity_entry: ParamEntry
    #: the shards whose gradient this is: the entry's, or one shard's (an optimizer's view)
    _infinity_shards: list[Shard]
    _generation: int

    @staticmethod
    def __new__(
        cls,
        access: ParamAccess,
        entry: ParamEntry,
        shard: Shard | None = None,
        shape: torch.Size | None = None,
    ) -> GradView:
        """The gradient of ``entry``; with ``shard``, of that one shard, as the wrapped
        optimizer's per-shard parameter (a host tensor of ``shape``) sees it."""
        assert entry.device_tensor is not None  # given at attach (adopt)
        if shard is None:
            shape, device = entry.shape, entry.device_tensor.device
        else:
            assert shard.step_param is not None  # made when the optimizer is wrapped
            shape, device = shape or torch.Size([shard.numel]), shard.step_param.device
        # The master dtype: the store keeps gradients in it (fp32 under bf16/fp16 compute, as
        # autocast's gradients are), so norms and clipping keep their precision.
        view = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=entry.dtype, device=device, requires_grad=False
        )
        view._infinity_access = access
        view._infinity_entry = entry
        view._infinity_shards = entry.shards if shard is None else [shard]
        view._generation = entry.grad_generation
        return view

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return intercepted(func, args, kwargs, _handle)

    # torch calls it with the op first (its documented protocol); its stub leaves ``func`` out
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # Reached only by ops torch runs below its Python API: answer from the values.
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            raise ParameterAccessError(f"{func} cannot write a gradient view in place")
        views = [t for t in tensors_in(args, kwargs) if isinstance(t, GradView)]
        args, kwargs = substitute(args, kwargs, {id(v): v.materialize() for v in views})
        return func(*args, **kwargs)

    # -- the gradient behind the view ---------------------------------------------------------
    @property
    def entry(self) -> ParamEntry:
        """The parameter whose gradient this views."""
        return self._infinity_entry

    @property
    def _gradients(self) -> Gradients:
        return self._infinity_access.placement.gradients

    def check_current(self) -> None:
        entry = self._infinity_entry
        if self._infinity_access.closed:
            raise ParameterAccessError(
                f"this p.grad of '{entry.name}' belongs to a TieredStore that is closed"
            )
        if self._generation != entry.grad_generation:
            raise ParameterAccessError(
                f"this p.grad of '{entry.name}' was taken before its gradient was consumed by "
                f"optimizer.step() or cleared by zero_grad(): read p.grad again"
            )

    def materialize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The gradient's values as a new tensor on the view's device (in ``dtype``, by
        default the view's)."""
        self.check_current()
        values = self._gradients.read_grad(self._infinity_entry)
        if self._infinity_shards is not self._infinity_entry.shards:  # one shard's part
            (shard,) = self._infinity_shards
            values = shard.padded(shard.part_of(values.view(-1))).view(self.shape)
        return values.to(device=self.device, dtype=dtype or self.dtype)

    def norm_value(self) -> float:
        self.check_current()
        gradients = self._gradients
        # The loop reads gradient norms (clipping, logging): from now on the gradient hook
        # keeps each shard's norm, so later steps answer without reading gradients back.
        if gradients.keep_norms():
            log.info("the training loop reads gradient norms: per-shard norms are kept from now on")
        return math.sqrt(gradients.global_sq_norms([self._infinity_shards])[0])

    def scale(self, factor: float) -> None:
        self.check_current()
        for shard in self._infinity_shards:
            shard.grad_scale *= factor

    def replace(self, value: torch.Tensor) -> None:
        """Stores ``value`` as this gradient (an in-place op's result); the view stays current."""
        self.check_current()
        entry = self._infinity_entry
        if self._infinity_shards is not entry.shards:
            raise ParameterAccessError(
                f"the optimizer's parameters are the store's per-shard copies of the model's: "
                f"their p.grad answers norms, scaling and zeroing (clip_grad_norm_), not other "
                f"in-place ops; apply those to the model's parameters' p.grad ('{entry.name}')"
            )
        self._gradients.replace_grad(
            entry, value.detach().to(device="cpu", dtype=entry.dtype), same_gradient=True
        )

    # torch's own Tensor.__repr__ has this signature, but mypy reads it as incompatible
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return repr(self.materialize())


def _handle(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    views = [t for t in tensors_in(args, kwargs) if isinstance(t, GradView)]
    for view in views:
        view.check_current()
        view._infinity_access.grads_used()
    first = args[0] if args else None
    if isinstance(first, GradView):
        if name in ("data.__get__", "detach", "alias") and len(args) == 1:
            whole = first._infinity_shards is first._infinity_entry.shards
            shard = None if whole else first._infinity_shards[0]
            return GradView(first._infinity_access, first._infinity_entry, shard, first.shape)
        if name in ("detach_", "requires_grad_"):
            return first
        if name == "data.__set__":
            first.replace(_values_of(args[1], first))
            return None
        if conversion_is_noop(name, first, args[1:], kwargs):
            return first
    norm = _norm(func, name, args, kwargs)
    if norm is not NotImplemented:
        return norm
    if name in _SCALES or name in _ZEROS:
        done = _scale(func, name, args, kwargs)
        if done is not NotImplemented:
            return done
    targets = [t for t in written(func, name, args, kwargs) if isinstance(t, GradView)]
    if targets:
        return _in_place(func, args, kwargs, targets)
    values = {id(v): v.materialize() for v in views}
    args, kwargs = substitute(args, kwargs, values)
    result = func(*args, **kwargs)
    source = ", ".join(sorted({v._infinity_entry.name for v in views}))
    return mark_snapshots(result, values.values(), f"the gradient of '{source}'")


def _values_of(value: Any, like: GradView) -> torch.Tensor:
    if isinstance(value, GradView):
        return value.materialize(torch.float32)
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        raise ParameterAccessError(
            f"the gradient of '{like._infinity_entry.name}' takes a tensor of shape "
            f"{tuple(like.shape)}, got {getattr(value, 'shape', type(value).__name__)}"
        )
    return value


def _whole_two_norm(func: Callable, name: str, view: GradView, order: Any) -> bool:
    """Whether this norm call (over all elements) is the 2-norm of the flattened tensor."""
    if name == "linalg_vector_norm" or name == "_foreach_norm":
        return order in (2, 2.0)
    if name == "linalg_norm":  # ord=None flattens; 'fro' on a matrix, 2 on a vector
        return (
            order is None
            or (order == "fro" and view.dim() == 2)
            or (order in (2, 2.0) and view.dim() == 1)
        )
    return order in (None, "fro", 2, 2.0)  # torch.norm, Tensor.norm


def _norm(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """The 2-norm of whole gradient views, from their shards' norms; NotImplemented for any
    other norm (another order, over some dims), which the values answer."""
    if name == "_foreach_norm":
        tensors = list(args[0])
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = kwargs.get("dtype")
        if not any(isinstance(t, GradView) for t in tensors) or not _whole_two_norm(
            func, name, tensors[0], order
        ):
            return NotImplemented
        views = [t for t in tensors if isinstance(t, GradView)]
        norms = iter(_norm_values(views))  # one collective for all of them across ranks
        return [
            torch.tensor(next(norms), dtype=dtype or t.dtype, device=t.device)
            if isinstance(t, GradView)
            else torch.linalg.vector_norm(t, dtype=dtype)
            for t in tensors
        ]
    if name not in _NORMS or not args or not isinstance(args[0], GradView):
        return NotImplemented
    default = 2 if name == "linalg_vector_norm" else None
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", default))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if (
        dim is not None
        or keepdim
        or kwargs.get("out") is not None
        or not _whole_two_norm(func, name, args[0], order)
    ):
        return NotImplemented
    return _norm_tensor(args[0], kwargs.get("dtype"))


def _norm_values(views: list[GradView]) -> list[float]:
    for view in views:
        view.check_current()
    if not views:
        return []
    gradients = views[0]._gradients
    if not gradients.track_grad_norms:
        views[0].norm_value()  # turns tracking on (and says so)
    return [math.sqrt(v) for v in gradients.global_sq_norms([v._infinity_shards for v in views])]


def _norm_tensor(view: GradView, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.tensor(view.norm_value(), dtype=dtype or view.dtype, device=view.device)


def _factor(value: Any) -> float | None:
    """A scalar multiplier (a number or a one-element tensor), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not isinstance(value, GradView):
        return float(value)
    return None


def _scale(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """Records ``mul_``/``div_`` by scalars and ``zero_`` on gradient views; NotImplemented
    when an argument is not a scalar (the values answer that)."""
    if kwargs:
        return NotImplemented
    foreach = name.startswith("_foreach_")
    tensors = list(args[0]) if foreach else [args[0]]
    if not tensors or not all(isinstance(t, GradView) for t in tensors):
        return NotImplemented
    if name in _ZEROS:
        factors = [0.0] * len(tensors)
    else:
        if len(args) != 2:
            return NotImplemented
        other = args[1]
        if foreach and isinstance(other, (list, tuple)):
            given = [_factor(v) for v in other]
        else:
            given = [_factor(other)] * len(tensors)
        factors = [f for f in given if f is not None]
        if len(factors) != len(given) or len(factors) != len(tensors):
            return NotImplemented
        if _SCALES[name]:
            if any(f == 0.0 for f in factors):
                return NotImplemented  # division by zero: the values say what it gives
            factors = [1.0 / f for f in factors]
    for view, factor in zip(tensors, factors):
        view.scale(factor)
    return None if foreach else args[0]


def _in_place(func: Callable, args: tuple, kwargs: dict, targets: list[GradView]) -> Any:
    """Any other in-place op on gradient views: on their values, stored back as the gradient."""
    values = {id(v): v.materialize() for v in tensors_in(args, kwargs) if isinstance(v, GradView)}
    new_args, new_kwargs = substitute(args, kwargs, values)
    func(*new_args, **new_kwargs)
    for target in targets:
        target.replace(values[id(target)])
    return args[0]
