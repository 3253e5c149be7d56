"""What a torch operation does to the tensors it is given, as far as the store needs to know:
whether it reads their values, writes them in place, or only asks for metadata.

Attached parameters and gradient views (``infinity.training.param_access``,
``infinity.training.grad_view``) see every operation on them through ``__torch_function__``, before
anything touches memory. Ops that only ask for metadata run as they are; reads get the values
materialised; in-place writes are checked against what the caller may write. Results that alias a
materialised copy are :class:`Snapshot` tensors: reading them works, writing them raises, since the
write would land in a temporary copy instead of the parameter.

The classification works on the Python-level callable torch hands ``__torch_function__``
(``Tensor.add_``, ``torch.add``, a property's ``__get__``/``__set__``), by torch's naming rule:
an in-place method ends in ``_`` (``add_``, ``_foreach_mul_``), augmented assignment reaches
``__torch_function__`` as that method, and ``out=`` names a written tensor too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex

import torch
from torch.utils._pytree import tree_flatten, tree_map

from infinity.errors import ParameterAccessError

Tensor = torch.Tensor

_METADATA_ATTRIBUTES = (
    "shape",
    "dtype",
    "device",
    "layout",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "ndim",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "is_mkldnn",
    "is_nested",
    "names",
    "output_nr",
    "_version",
    "_base",
    "itemsize",
    "nbytes",
    "retains_grad",
    "name",
    "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "grad_dtype",
)
_METADATA_METHODS = (
    "size",
    "dim",
    "numel",
    "nelement",
    "element_size",
    "stride",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "is_signed",
    "requires_grad_",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "retain_grad",
    "get_device",
    "storage_offset",
    "is_pinned",
    "is_shared",
    "is_inference",
    "_is_view",
    "has_names",
    "data_ptr",
    "untyped_storage",
    "__len__",
    "__dlpack_device__",
    "__hash__",
)


def _metadata() -> frozenset:
    found: set = set()
    for name in _METADATA_ATTRIBUTES:
        # Properties are on torch._C.TensorBase or Tensor; some are missing in older torch.
        descriptor = (
            getattr(Tensor, name, None)
            if name in Tensor.__dict__
            else torch._C.TensorBase.__dict__.get(name)
        )
        for accessor in ("__get__", "__set__"):
            if hasattr(descriptor, accessor):
                found.add(getattr(descriptor, accessor))
    found.update(getattr(Tensor, name) for name in _METADATA_METHODS if hasattr(Tensor, name))
    found.update(
        (torch.numel, torch.is_floating_point, torch.is_complex, torch.is_tensor, torch.is_storage)
    )
    return frozenset(found)


#: property accessors and methods that never read a tensor's values
METADATA: frozenset = _metadata()

#: in-place methods that change metadata, not values
_INPLACE_METADATA = frozenset({"requires_grad_", "retain_grad", "rename_", "detach_"})

#: conversions that return the tensor itself when nothing changes (as torch does)
_CONVERSIONS = {
    "to": None,
    "cpu": None,
    "cuda": None,
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def run_plain(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` with every tensor treated as a plain tensor (no ``__torch_function__``)."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def intercepted(
    func: Callable,
    args: tuple,
    kwargs: dict | None,
    handle: Callable[[Callable, str, tuple, dict], Any],
) -> Any:
    """The body of a ``__torch_function__``: metadata runs as it is; anything else goes to
    ``handle(func, name, args, kwargs)``, under which tensors are plain again (its own ops
    are not intercepted)."""
    kwargs = kwargs or {}
    if func in METADATA:
        return run_plain(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return handle(func, name_of(func), args, kwargs)


def name_of(func: Callable) -> str:
    """``add_`` for ``Tensor.add_``; ``data.__set__`` for a property's setter."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "?")
        return f"{owner}.{name}"
    return name


def is_inplace(name: str) -> bool:
    if name in ("__setitem__", "data.__set__", "grad.__set__"):
        return True
    if name.startswith("__") or "." in name:  # dunders; other properties' accessors
        return False
    return name.endswith("_") and name not in _INPLACE_METADATA


def written(func: Callable, name: str, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors ``func(*args, **kwargs)`` writes in place: the first argument of an in-place
    method or function (each tensor of it, for ``torch._foreach_*_``), and ``out=``."""
    out: list[Tensor] = []
    if is_inplace(name) and args:
        target = args[0]
        if isinstance(target, Tensor):
            out.append(target)
        elif isinstance(target, (list, tuple)):
            out += [t for t in target if isinstance(t, Tensor)]
    if "out" in kwargs:
        out += [t for t in tree_flatten(kwargs["out"])[0] if isinstance(t, Tensor)]
    return out


def tensors_in(args: tuple, kwargs: dict) -> list[Tensor]:
    # Most calls (every op of a forward on a parameter) pass flat positional arguments: a
    # pytree walk there would cost more than the op.
    if not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args):
        return [a for a in args if isinstance(a, Tensor)]
    return [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, Tensor)]


def conversion_is_noop(name: str, tensor: Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.<name>(*args, **kwargs)`` (``to``, ``cpu``, ``float``, ...) would return
    the tensor itself: ``Module.to`` and ``Trainer`` call these on every parameter."""
    if (
        name not in _CONVERSIONS
        or kwargs.get("copy")
        or kwargs.get("memory_format") not in (None, torch.preserve_format)
    ):
        return False
    device, dtype = tensor.device, tensor.dtype
    if name == "to":
        try:
            to_device, to_dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):
            return False
        if isinstance(args[0] if args else None, Tensor):  # .to(other): its device and dtype
            to_device, to_dtype = args[0].device, args[0].dtype
        same_device = to_device is None or _same_device(torch.device(to_device), device)
        return (
            same_device
            and (to_dtype is None or to_dtype == dtype)
            and memory_format in (None, torch.preserve_format)
        )
    if args:
        return False
    if name == "cpu":
        return device.type == "cpu"
    if name == "cuda":
        return device.type == "cuda" and (not args or args[0] is None)
    return dtype == _CONVERSIONS[name]


def _same_device(wanted: torch.device, actual: torch.device) -> bool:
    if wanted.type != actual.type:
        return False
    if actual.type == "cpu":
        # One CPU device whatever the index: accelerate hands each rank torch.device("cpu", 0),
        # and Trainer moves the model there.
        return True
    if wanted.index is None:
        return (
            actual.index in (None, torch.cuda.current_device()) if actual.type == "cuda" else True
        )
    return wanted.index == actual.index


def substitute(args: tuple, kwargs: dict, values: dict[int, Tensor]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor whose id is in ``values`` replaced."""

    def swap(value: Any) -> Any:
        return values.get(id(value), value) if isinstance(value, Tensor) else value

    return tree_map(swap, args), tree_map(swap, kwargs)


class Snapshot(Tensor):
    """A tensor that aliases values materialised from the store (a view of a parameter's or a
    gradient's values, taken outside forward). Reading it works; an in-place write raises,
    because it would change the copy and never reach the store."""

    _infinity_source = "a parameter"

    @classmethod
    def __torch_function__(
        cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return intercepted(func, args, kwargs, cls._checked)

    @staticmethod
    def _checked(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        for target in written(func, name, args, kwargs):
            if isinstance(target, Snapshot):
                raise ParameterAccessError(
                    f"this tensor is a view of {target._infinity_source}'s values, "
                    f"materialised from the store outside forward: `{name}` would change the "
                    f"copy, not the store. Write the parameter inside "
                    f"`with store.gathered([param], modify=True):`, assign p.grad for a "
                    f"gradient, or .clone() the view to own a copy"
                )
        sources = [t for t in tensors_in(args, kwargs) if isinstance(t, Snapshot)]
        result = func(*args, **kwargs)
        return mark_snapshots(result, sources, sources[0]._infinity_source if sources else "")

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return run_plain(Tensor.__reduce_ex__, (self.as_subclass(Tensor), protocol), {})


def mark_snapshots(result: Any, copies: Iterable[Tensor], source: str) -> Any:
    """``result`` with each tensor in it that shares storage with one of ``copies`` made a
    :class:`Snapshot` of ``source``."""
    pointers = set()
    for copy in copies:
        pointer = copy.untyped_storage().data_ptr()
        if pointer:
            pointers.add(pointer)
    if not pointers:
        return result

    def mark(value: Any) -> Any:
        if (
            isinstance(value, Tensor)
            and not isinstance(value, Snapshot)
            and type(value) is Tensor
            and value.untyped_storage().data_ptr() in pointers
        ):
            snapshot = value.as_subclass(Snapshot)
            snapshot._infinity_source = source
            return snapshot
        return value

    if isinstance(result, Tensor):
        return mark(result)
    if isinstance(result, (list, tuple)):
        return type(result)(mark(v) for v in result) if not hasattr(result, "_fields") else result
    return result
