"""Attached parameters outside forward: reads served from the store, writes through one door.

Between uses an attached parameter shares an empty storage with its device working copy (the
gathers refill that same storage, so views autograd saved in forward see the values again).
Touching that storage outside the hooks would read memory that is not there. So ``attach`` makes
each parameter an instance of a subclass of its own class (as FSDP2's ``fully_shard`` does with
modules: ``isinstance`` checks keep holding, nothing in torch is patched), whose
``__torch_function__`` sees every operation on it first and asks :class:`ParamAccess`:

* metadata (``shape``, ``dtype``, ``device``, ``numel()``, ``requires_grad_()``, hooks) runs as
  it is, and so does a conversion that changes nothing (``p.to(p.device)``, ``Module.to``);
* while the parameter is in use (a module's forward or backward, ``store.gathered``) every
  operation runs on the device copy, as in plain torch;
* any other read gets the current values, read through the tiers within the budgets (the
  device copy when one is cached, else the masters), differentiably when autograd records:
  ``(p ** 2).sum()`` outside forward still sends its gradient to ``p``. Views of such values are
  :class:`~infinity.training.op_kinds.Snapshot` tensors, which refuse writes;
* ``p.data`` and ``p.detach()`` are aliases that stay tied to the parameter (class
  ``OffloadedTensor``): reads see the current values, writes obey the same rule as ``p``'s;
* an in-place write (``p.data.zero_()``, ``p.copy_(x)``, ``p[0] = 1``, ``p.data = x``,
  ``nn.init.*``) is allowed only inside ``with store.gathered(params, modify=True):``, and
  raises :class:`~infinity.errors.ParameterAccessError` anywhere else: outside, the value lives
  in the tiers; inside forward, a write to the device copy would be lost at its next eviction;
* ``p.grad`` is a :class:`~infinity.training.grad_view.GradView` of the gradient the store holds.

``gathered`` holds the parameters on the device; on leaving with ``modify=True`` it compares each
one with its master and writes back what changed (under mixed precision, only the elements that
changed: an untouched fp32 master is never rounded to the compute dtype), so the next forward,
``state_dict()`` and the optimizer see the edit; optimizer state is kept.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infinity.core.overwrite import write_entry
from infinity.core.shards import ParamEntry
from infinity.errors import AttachError, BudgetError, ParameterAccessError
from infinity.training.grad_view import GradView
from infinity.training.hooks import _normal_tensors
from infinity.training.op_kinds import (
    conversion_is_noop,
    intercepted,
    mark_snapshots,
    substitute,
    tensors_in,
    written,
)

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


log = logging.getLogger(__name__)

#: ops that use a tensor argument after the first only for its shape, dtype or device
_SHAPE_ONLY_OTHERS = frozenset({"view_as", "expand_as", "reshape_as", "type_as"})
#: ops that show values: no autograd node for them
_DISPLAY = frozenset({"__repr__", "__format__", "__str__"})
#: ops that use every tensor argument only for its shape, dtype or device
_SHAPE_ONLY = frozenset(
    {
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
    }
)


class _ReadParameter(torch.autograd.Function):
    """A parameter's values read outside its module's hooks, as a node of the autograd graph:
    the gradient of whatever is computed from them reaches the parameter as usual."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        return read()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SavedParameter:
    """An attached parameter as a saved-tensors hook keeps it for backward (pack), and what
    backward gets back (unpack): see :meth:`ParamAccess.saved`."""

    __slots__ = ("access", "param")

    def __init__(self, access: ParamAccess, param: torch.Tensor) -> None:
        self.access = access
        self.param = param

    def unpack(self) -> torch.Tensor:
        return self.access.values_for_backward(self.param)


class _ParamAlias(torch.Tensor):
    """The base of each ParamAccess's alias class (``p.data``, ``p.detach()``): an alias
    knows the parameter it stays tied to."""

    _infinity_entry: ParamEntry


class ParamAccess:
    """The store's side of every operation on an attached parameter outside the hooks."""

    def __init__(self, store: AttachedStore) -> None:
        self.store = store
        self.registry = store.registry
        placement = store.placement
        assert placement is not None  # made by attach, after the placement
        self.placement = placement
        #: entry index -> the parameter's own class, restored at close
        self._original: dict[int, type] = {}
        self._classes: dict[type, type] = {}
        #: entry index -> open ``gathered(modify=True)`` contexts holding it
        self.modifying: dict[int, int] = {}
        self.closed = False
        self._warned_consumed = False
        #: ``p.data`` and ``p.detach()``: an alias that stays tied to the parameter
        self.alias_class: type[_ParamAlias] = self._new_alias_class(self)
        #: the alias class and the attached parameters' classes
        self._own_types: set[type] = {self.alias_class}

    @staticmethod
    def _new_alias_class(access: ParamAccess) -> type[_ParamAlias]:
        def alias_function(
            cls: type, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            return access.handle(func, args, kwargs)

        return type(
            "OffloadedTensor",
            (_ParamAlias,),
            {
                "__torch_function__": classmethod(alias_function),
                "__module__": __name__,
                "__reduce_ex__": lambda t, protocol: access._reduce(t, protocol),
                "__deepcopy__": lambda t, memo: access._values(access._attached(t)),
            },
        )

    # -- install and remove -------------------------------------------------------------------
    def install(self) -> None:
        for entry in self.registry.entries:
            param = entry.param
            cls = type(param)
            function = getattr(cls, "__torch_function__", None)
            if function is not torch._C._disabled_torch_function_impl:
                raise AttachError(
                    f"parameter '{entry.name}' is a {cls.__name__} with its own "
                    f"__torch_function__; the store serves reads of attached parameters "
                    f"through one, so it cannot attach this class: use plain nn.Parameter"
                )
            self._original[entry.index] = cls
            param.__class__ = self._class_for(cls)

    def remove(self) -> None:
        """Gives every parameter its own class back (at close, before the values return)."""
        for entry in self.registry.entries:
            cls = self._original.pop(entry.index, None)
            if cls is not None:
                entry.param.__class__ = cls
        self.closed = True

    def computing(self, entries: Iterable[ParamEntry], live: bool) -> None:
        """While a forward or backward computes with them, parameters are instances of their
        own class again: every operation then runs on the device copy, which they hold, without
        a ``__torch_function__`` in the way (torch.compile traces the module as it would without
        the store, instead of tracing the store's handler). Once the last hold is gone they are
        attached again (``live=False``)."""
        for entry in entries:
            cls = self._original.get(entry.index)
            if cls is None:
                continue
            if live:
                entry.param.__class__ = cls
            elif not entry.holds:
                entry.param.__class__ = self._classes[cls]

    def _class_for(self, cls: type) -> type:
        found = self._classes.get(cls)
        if found is None:
            access = self

            def torch_function(
                klass: type,
                func: Callable,
                types: Any,
                args: tuple = (),
                kwargs: dict | None = None,
            ) -> Any:
                return access.handle(func, args, kwargs)

            def deepcopy(param: nn.Parameter, memo: dict) -> nn.Parameter:
                # A copy is an ordinary parameter of the original class, with the values now.
                entry = access._attached(param)
                copy = cls(access._values(entry), requires_grad=param.requires_grad)
                memo[id(param)] = copy
                return copy

            found = type(
                f"Attached{cls.__name__}",
                (cls,),
                {
                    "__torch_function__": classmethod(torch_function),
                    "__deepcopy__": deepcopy,
                    "__reduce_ex__": lambda p, protocol: access._reduce(p, protocol, cls),
                    "__module__": __name__,
                },
            )
            self._classes[cls] = found
            self._own_types.add(found)
        return found

    # -- every operation --------------------------------------------------------------------------
    def handle(self, func: Callable, args: tuple, kwargs: dict | None) -> Any:
        return intercepted(func, args, kwargs, self._handle)

    def _handle(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        if self.closed:
            return self._after_close(func, args, kwargs)
        if name == "grad.__get__":
            return self._grad_of(args[0])
        if name == "grad.__set__":
            return self._set_grad(args[0], args[1])
        if name == "data.__set__":
            return self._set_data(args[0], args[1])
        if name in ("data.__get__", "detach") and len(args) == 1 and not kwargs:
            return self._alias(args[0], func(*args))
        found: list[tuple[torch.Tensor, ParamEntry]] = []
        for tensor in tensors_in(args, kwargs):
            entry = self._entry_of(tensor) if self._ours(tensor) else None
            if entry is not None:
                found.append((tensor, entry))
        for target in written(func, name, args, kwargs):
            entry = self._entry_of(target) if self._ours(target) else None
            if entry is not None:
                self._check_write(entry, name)
        if name in _SHAPE_ONLY or (
            name in _SHAPE_ONLY_OTHERS and not any(t is args[0] for t, _ in found)
        ):
            return func(*args, **kwargs)
        if args and self._ours(args[0]) and conversion_is_noop(name, args[0], args[1:], kwargs):
            return args[0]
        if all(self._live(entry) for _, entry in found):
            return func(*args, **kwargs)
        values: dict[int, torch.Tensor] = {}
        display = name in _DISPLAY
        for tensor, entry in found:
            if id(tensor) not in values and not self._live(entry):
                self.store.stepping.loop_acted(f"a read of parameter {entry.name}")
                values[id(tensor)] = self._read(tensor, entry, display)
        args, kwargs = substitute(args, kwargs, values)
        result = func(*args, **kwargs)
        names = sorted({entry.name for _, entry in found})
        return mark_snapshots(result, values.values(), f"parameter '{', '.join(names)}'")

    def _ours(self, tensor: torch.Tensor) -> bool:
        return type(tensor) in self._own_types

    def _entry_of(self, tensor: torch.Tensor) -> ParamEntry | None:
        if isinstance(tensor, self.alias_class):
            return tensor._infinity_entry
        return self.registry.entry_of(tensor)

    def _attached(self, tensor: torch.Tensor) -> ParamEntry:
        """The entry of an attached parameter or an alias of one."""
        entry = self._entry_of(tensor)
        assert entry is not None, "not an attached parameter"
        return entry

    @staticmethod
    def _live(entry: ParamEntry) -> bool:
        """In use on the device (a forward, a backward, ``gathered``): operations run there."""
        return entry.resident and entry.holds > 0

    def _check_write(self, entry: ParamEntry, name: str) -> None:
        if self.modifying.get(entry.index):
            return
        where = (
            "inside store.gathered() without modify=True, where a write to the device "
            "copy would be lost at its next eviction"
            if self._live(entry)
            else "here: between uses its values live in the store's tiers, not in this tensor"
        )
        raise ParameterAccessError(
            f"parameter '{entry.name}' is attached to a TieredStore and cannot be written in "
            f"place (`{name}`) {where}. Write it inside "
            f"`with store.gathered([param], modify=True):`, which writes the new values back "
            f"to the store (and NVMe) on exit. (An optimizer stepping it was built after "
            f"attach: build it first and pass it to store.attach(model, optimizer).)"
        )

    # -- saved for backward -----------------------------------------------------------------------
    def saved(self, tensor: torch.Tensor) -> SavedParameter | None:
        """What a saved-tensors hook (the activation offload, the saved-activation meter) keeps
        of ``tensor`` when it is an attached parameter; None for any other tensor.

        Under such hooks autograd gives backward a plain tensor over the saved one's storage,
        not the parameter. A parameter's storage is empty between uses, and only its own
        module's backward fills it again: a parameter saved outside its module's hooks (TRL's
        fused LM head hands ``lm_head.weight`` to an autograd Function of its own) would be
        read empty. Its values are given instead (:meth:`values_for_backward`)."""
        if not self._ours(tensor) or isinstance(tensor, self.alias_class):
            return None
        if self.registry.entry_of(tensor) is None:
            return None
        return SavedParameter(self, tensor)

    def values_for_backward(self, param: torch.Tensor) -> torch.Tensor:
        """A saved parameter's values for the backward node that saved it: the parameter
        itself while its module's backward holds it on the device, else its current values."""
        entry = self._attached(param)
        if self._live(entry):
            return param
        with torch.no_grad():
            return self._values(entry)

    # -- reads ------------------------------------------------------------------------------------
    def _values(self, entry: ParamEntry) -> torch.Tensor:
        """The parameter's current values as a new tensor on its device, in its dtype."""
        device_tensor = entry.device_tensor
        assert device_tensor is not None  # given at attach (adopt)
        if entry.resident:
            self.placement.settle(entry)  # a look-ahead's all-gathers may be under way
            return device_tensor.clone()
        host = self.store.materialize(entry)
        return host.to(device=device_tensor.device, dtype=entry.compute_dtype)

    def _read(self, tensor: torch.Tensor, entry: ParamEntry, display: bool = False) -> torch.Tensor:
        if tensor is entry.param and tensor.requires_grad:
            if display:  # printed as the parameter prints: a leaf that requires grad
                return self._values(entry).requires_grad_()
            if torch.is_grad_enabled():
                return _ReadParameter.apply(tensor, lambda: self._values(entry))
        return self._values(entry)

    def _alias(self, source: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
        alias = plain.as_subclass(self.alias_class)
        alias._infinity_entry = self._attached(source)
        return alias

    def _reduce(self, tensor: torch.Tensor, protocol: int, cls: type | None = None) -> Any:
        """Pickling (``torch.save`` of a parameter or alias) saves the values, as an object of
        the original class."""
        values = self._values(self._attached(tensor))
        if cls is not None:
            values = cls(values, requires_grad=tensor.requires_grad)
        return values.__reduce_ex__(protocol)

    def _after_close(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An alias kept past ``close()``: the parameter has its values back; use them."""
        values = {
            id(t): t._infinity_entry.param.data
            for t in tensors_in(args, kwargs)
            if isinstance(t, self.alias_class)
        }
        args, kwargs = substitute(args, kwargs, values)
        return func(*args, **kwargs)

    # -- .grad and .data -------------------------------------------------------------------------
    def _grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        entry = self._entry_of(param)
        placement = self.placement
        if entry is not None and any(placement.gradients.has_grad(s) for s in entry.shards):
            return GradView(self, entry)
        stepping = self.store.stepping
        if entry is None or entry.index not in stepping.updated_in_backward:
            return param.grad
        # Consumed by its update in backward:
        stepping.loop_acted(f"p.grad of {entry.name} read", grads=True)
        timing = self.store.update_timing
        if not self._warned_consumed and timing is not None and not timing.auto:
            self._warned_consumed = True
            log.warning(
                "p.grad of %s is None: step_in_backward=True applied each gradient in "
                "backward as it completed, so the loop cannot read or clip them; turn "
                "it off to use p.grad or clip_grad_norm_",
                entry.name,
            )
        return param.grad

    def _set_grad(self, param: torch.Tensor, value: torch.Tensor | None) -> None:
        entry = self._attached(param)
        if entry.quantized and value is not None:
            raise ParameterAccessError(
                f"p.grad of '{entry.name}': the weight is stored quantized (precision."
                f"storage_dtype int8/int4, for inference) and keeps no gradient; set p.grad only "
                f"on weights stored as floats (storage_dtype 'auto', 'bf16' or 'fp32')"
            )
        if isinstance(value, GradView) and value.entry is entry:
            value.check_current()
            return  # p.grad = p.grad
        if value is not None:
            self.grads_used()
            if not isinstance(value, torch.Tensor) or value.shape != entry.shape:
                raise ParameterAccessError(
                    f"p.grad of '{entry.name}' must be a tensor of shape {tuple(entry.shape)}, "
                    f"got {getattr(value, 'shape', type(value).__name__)}"
                )
            if isinstance(value, GradView):
                value = value.materialize()
            value = value.detach().to(device="cpu", dtype=entry.dtype).clone()
        self.placement.gradients.replace_grad(entry, value)
        param.grad = None  # torch function is off here: the autograd field
        if value is None:
            self.store.stepping.gradients_cleared()

    def grads_used(self) -> None:
        """The loop used a gradient (read its values or norm, scaled or set it)."""
        self.store.stepping.loop_acted("the loop used p.grad (clipping, norms?)", grads=True)

    def _set_data(self, target: torch.Tensor, value: Any) -> None:
        entry = self._attached(target)
        assert entry.device_tensor is not None  # given at attach (adopt)
        if (
            isinstance(value, torch.Tensor)
            and value.shape == entry.shape
            and _same_storage(value, entry.device_tensor)
        ):
            return  # p.data = p (Module.to when nothing changes)
        if isinstance(target, self.alias_class):
            raise ParameterAccessError(
                f"assigning .data of a tensor taken from parameter '{entry.name}' (p.data or "
                f"p.detach()) would not change the parameter: assign p.data inside "
                f"`with store.gathered([p], modify=True):`"
            )
        if not self.modifying.get(entry.index):
            _refuse_conversion(entry, value)
        self._check_write(entry, "data.__set__")
        target.data = value  # torch function is off here: the real assignment

    # -- store.gathered -----------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(
        self, params: Iterable[torch.Tensor] | None = None, modify: bool = False
    ) -> Iterator[None]:
        entries = self._entries_for(params)
        placement = self.placement
        self.store.stepping.loop_acted("store.gathered()")
        if modify:
            busy = [e.name for e in entries if e.holds]
            if busy:
                raise ParameterAccessError(
                    f"store.gathered(modify=True) while {', '.join(busy[:3])} "
                    f"{'is' if len(busy) == 1 else 'are'} in use by a forward or backward pass "
                    f"or another gathered(): modify parameters outside those"
                )
        taken: list[ParamEntry] = []
        try:
            with _normal_tensors():
                for entry in entries:
                    placement.gather(entry)
                    taken.append(entry)
        except BudgetError as exc:
            for entry in taken:
                placement.release(entry)
            raise BudgetError(
                f"store.gathered() holds its {len(entries)} parameters on the device at once "
                f"({sum(e.device_bytes for e in entries)} bytes): {exc}; pass fewer, e.g. one "
                f"module's .parameters() at a time"
            ) from exc
        if modify:
            for entry in entries:
                self.modifying[entry.index] = self.modifying.get(entry.index, 0) + 1
        try:
            yield
        finally:
            with torch._C.DisableTorchFunctionSubclass():
                edited = [(entry, self._take_back(entry)) for entry in entries] if modify else []
            for entry in entries:
                if modify:
                    self.modifying[entry.index] -= 1
                    if not self.modifying[entry.index]:
                        del self.modifying[entry.index]
                placement.release(entry)
            self.computing(entries, False)  # a forward inside the block left them plain
            for entry, value in edited:
                self._write_back(entry, value)

    def _entries_for(self, params: Iterable[torch.Tensor] | None) -> list[ParamEntry]:
        if params is None:
            return list(self.registry.entries)
        if isinstance(params, torch.Tensor):
            params = [params]
        entries: list[ParamEntry] = []
        for param in params:
            entry = self._entry_of(param) if isinstance(param, torch.Tensor) else None
            if entry is None:
                shape = f" of shape {tuple(param.shape)}" if isinstance(param, torch.Tensor) else ""
                raise ParameterAccessError(
                    f"store.gathered() takes parameters of the attached model; got "
                    f"{type(param).__name__}{shape}"
                )
            if entry not in entries:
                entries.append(entry)
        return entries

    def _take_back(self, entry: ParamEntry) -> torch.Tensor:
        """The values the parameter holds on leaving ``gathered(modify=True)``, as a host copy;
        a parameter whose ``.data`` was assigned inside shares its device storage again."""
        param = entry.param
        current = param.data
        device = entry.device_tensor
        assert device is not None  # given at attach (adopt)
        if _same_storage(current, device):
            return current.detach().to("cpu", copy=True)
        param.data = device  # shares the device storage again
        if current.shape != entry.shape:
            raise ParameterAccessError(
                f"parameter '{entry.name}' was given .data of shape {tuple(current.shape)} "
                f"inside store.gathered(); attached parameters keep their shape "
                f"{tuple(entry.shape)}. Its values are unchanged"
            )
        return current.detach().to(device="cpu", dtype=entry.compute_dtype, copy=True)

    def _write_back(self, entry: ParamEntry, value: torch.Tensor) -> None:
        """Writes the elements that changed to the master (and NVMe); nothing when none did."""
        # The masters themselves, not the cached device copy (rounded under mixed precision).
        self.placement.drop_device(entry, force=True)
        master = self.store.materialize(entry)
        # (a quantized weight's values are its decoded ones, in the compute dtype)
        if entry.quantized or entry.compute_dtype == entry.dtype:
            if torch.equal(value, master):
                return
            new = value
        else:
            changed = value != master.to(entry.compute_dtype)
            if not bool(changed.any()):
                return
            new = torch.where(changed, value.to(entry.dtype), master)
        write_entry(self.store, entry, new)
        log.debug("gathered(modify=True): wrote back %s", entry.name)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same storage object (not merely the same address: every empty storage has 0)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _refuse_conversion(entry: ParamEntry, value: Any) -> None:
    """``Module.to(dtype)``, ``.half()``, ``.to(other device)`` assign each parameter a converted
    copy: an attached parameter's dtype and device are the store's, so say which setting
    decides them instead of the general in-place refusal."""
    if not isinstance(value, torch.Tensor) or value.shape != entry.shape:
        return
    assert entry.device_tensor is not None  # given at attach (adopt)
    device = entry.device_tensor.device
    if value.dtype != entry.compute_dtype:
        raise ParameterAccessError(
            f"parameter '{entry.name}' is attached to a TieredStore, which computes in "
            f"{entry.compute_dtype} (its masters are {entry.dtype}): converting the model to "
            f"{value.dtype} (model.to(dtype), .half(), .bfloat16(), .float()) is refused. The "
            f"store's precision decides the dtype: set OffloadConfig.precision (e.g. "
            f"precision=PrecisionConfig(dtype='bf16')), and leave a trainer's own fp16/bf16 "
            f"settings off"
        )
    if value.device != device:
        raise ParameterAccessError(
            f"parameter '{entry.name}' is attached to a TieredStore that computes on {device}: "
            f"moving the model to {value.device} is refused (the store places the parameters; "
            f"OffloadConfig.device decides where). Across ranks on GPUs, call "
            f"torch.cuda.set_device(local_rank) before creating the store, so that each rank's "
            f"store computes on its own cuda:LOCAL_RANK"
        )
