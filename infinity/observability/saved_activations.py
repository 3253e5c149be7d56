"""Counting the activations autograd saves in forward, where nothing moves them.

On a CPU device the tensors autograd keeps from forward for backward are host memory outside
every budget (their size follows the tokens per micro-batch, not the model's state), so the RSS
bound (:mod:`infinity.core.budgets`) adds their peak as measured here. A saved-tensors hook
around the model's forward counts each saved storage once while autograd holds it: views of one
storage (``q``, ``k``, ``v`` split from one output) count once, parameters and the store's own
memory (the device tier's copies, the arena) not at all. The hooks change nothing: pack keeps the
tensor itself, unpack gives it back; an attached parameter's values are given back as backward
would have read them without the hooks (ParamAccess.saved).

``offload_activations='cpu'`` or ``'nvme'`` count their own (``stats()['activations']``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from infinity.core.finalizers import interrupt_safe
from infinity.training.param_access import SavedParameter


class _Held:
    """A saved tensor, counted until autograd lets it go."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedActivationMeter) -> None:
        self.tensor = tensor
        self.key = key
        self.meter = meter

    @interrupt_safe  # runs wherever autograd drops it: a Ctrl-C landing here must not be lost
    def __del__(self) -> None:
        self.meter._let_go(self.key)


class SavedActivationMeter:
    """Current and peak bytes of the activations autograd holds for backward."""

    def __init__(
        self,
        store_owns: Callable[[int], bool],
        saved_parameter: Callable[[torch.Tensor], SavedParameter | None],
    ) -> None:
        """``store_owns(address)``: whether a storage at that address is the store's (the device
        tier's copies, the arena), which the tiers count already. ``saved_parameter``: what to
        keep of an attached parameter (ParamAccess.saved), whose values backward must get back
        rather than autograd's plain tensor over its storage."""
        self._store_owns = store_owns
        self._saved_parameter = saved_parameter
        self._lock = threading.Lock()  # autograd may free saved tensors on its own threads
        self._refs: dict[int, list[int]] = {}  # storage address -> [references, bytes]
        self.current_bytes = 0
        self.peak_bytes = 0
        self._depth = 0
        self._hooks: Any = None
        self.handles: list[Any] = []

    def install(self, root: nn.Module) -> None:
        meter = self

        def pre(module: nn.Module, args: Any) -> None:
            if module is root:
                meter._enter()

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if module is root:
                meter._exit()

        self.handles.append(root.register_forward_pre_hook(_opaque(pre)))
        self.handles.append(root.register_forward_hook(_opaque(post), always_call=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _enter(self) -> None:
        self._depth += 1
        if self._depth > 1 or not torch.is_grad_enabled() or self._hooks is not None:
            return
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> Any:
        kept = self._saved_parameter(tensor)
        if kept is not None:
            return kept
        if (
            isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)
            or tensor.device.type != "cpu"
            or tensor.layout is not torch.strided
        ):
            return tensor
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        nbytes = storage.nbytes()
        if not address or not nbytes or self._store_owns(address):
            return tensor
        with self._lock:
            ref = self._refs.get(address)
            if ref is None:
                self._refs[address] = [1, nbytes]
                self.current_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            else:
                ref[0] += 1
        # Detached: a saved output holding its own grad_fn would be a cycle through autograd's
        # C++ nodes that Python's collector cannot see, and the graph of a forward whose
        # backward never comes (an evaluation with gradients on) would never be freed.
        return _Held(tensor.detach(), address, self)

    def _let_go(self, address: int) -> None:
        with self._lock:
            ref = self._refs.get(address)
            if ref is None:
                return
            ref[0] -= 1
            if not ref[0]:
                del self._refs[address]
                self.current_bytes -= ref[1]


def _unpack(held: Any) -> torch.Tensor:
    if isinstance(held, SavedParameter):
        return held.unpack()
    return held.tensor if isinstance(held, _Held) else held


def _opaque(hook: Callable) -> Callable:
    """Run as Python, never traced by torch.compile (as the store's own hooks)."""
    return torch.compiler.disable(hook, recursive=True)


__all__ = ["SavedActivationMeter"]
