"""Module hooks that gather parameters just before a module runs and release them after.

Forward: a pre-hook gathers the module's own parameters onto the device, a post-hook releases
them. Backward: the forward post-hook puts a hook on each output that requires grad; the first of
them to fire (the gradient reached the module's output, so its backward is next) gathers the
parameters again. Each parameter's post-accumulate-grad hook fires once its gradient is complete
for this backward pass (all uses summed); it moves the gradient to the host and drops the
backward holds. Whatever is still held when the backward pass ends (frozen parameters, unused
outputs) is released by a callback queued on the autograd engine.

Only public hook APIs are used; nothing in torch is patched.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from infinity.shards import ParamEntry
from infinity.trace import BACKWARD, FORWARD, Event

log = logging.getLogger(__name__)


class HookSet:
    """Installs and removes the hooks of one attached model."""

    def __init__(self, store: Any, root: nn.Module,
                 module_entries: list[tuple[nn.Module, list[ParamEntry]]]) -> None:
        self.store = store
        self.placement = store.placement
        self.root = root
        self.modules = module_entries
        self.handles: list[Any] = []
        #: entries gathered for backward and not yet released: entry -> count
        self.backward_holds: dict[ParamEntry, int] = {}
        self._callback_queued = False

    def install(self) -> None:
        self.handles.append(self.root.register_forward_pre_hook(self._root_pre_forward))
        for index, (module, entries) in enumerate(self.modules):
            self.handles.append(module.register_forward_pre_hook(
                self._make_pre_forward(index, entries)))
            # always_call: activation checkpointing stops a recomputation early by raising out
            # of a module's forward, and the holds taken by its pre-hook must still be released.
            self.handles.append(module.register_forward_hook(
                self._make_post_forward(index, entries), always_call=True))
        seen: set[int] = set()
        for _, entries in self.modules:
            for entry in entries:
                if entry.requires_grad and id(entry.param) not in seen:
                    seen.add(id(entry.param))
                    self.handles.append(entry.param.register_post_accumulate_grad_hook(
                        self._make_grad_hook(entry)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- forward ------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        # A new iteration starts with the root's forward, unless we are inside a backward pass
        # (activation checkpointing re-runs forwards there).
        if not self.backward_holds:
            self.store._start_iteration(torch.is_grad_enabled(), module.training)

    def _make_pre_forward(self, index: int, entries: list[ParamEntry]) -> Callable:
        event = Event(FORWARD, index, tuple(e.index for e in entries))

        def pre_forward(module: nn.Module, args: Any) -> None:
            self.placement.on_event(event)
            for entry in entries:
                self.placement.gather(entry)
        return pre_forward

    def _make_post_forward(self, index: int, entries: list[ParamEntry]) -> Callable:
        event = Event(BACKWARD, index, tuple(e.index for e in entries))

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            for entry in entries:
                self.placement.release(entry)
            if torch.is_grad_enabled():
                self._hook_outputs(output, event, entries)
        return post_forward

    # -- backward -----------------------------------------------------------------------------
    def _hook_outputs(self, output: Any, event: Event, entries: list[ParamEntry]) -> None:
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
        if not tensors:
            return
        fired = [False]

        def pre_backward(grad: torch.Tensor) -> None:
            if fired[0]:
                return
            fired[0] = True
            self._queue_end_of_backward()
            self.placement.on_event(event)
            for entry in entries:
                self.placement.gather(entry)
                self.backward_holds[entry] = self.backward_holds.get(entry, 0) + 1

        for tensor in tensors:
            tensor.register_hook(pre_backward)

    def _make_grad_hook(self, entry: ParamEntry) -> Callable:
        def grad_ready(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is not None:
                self.placement.take_grad(entry, grad)
                param.grad = None
            self._release_backward(entry)
        return grad_ready

    def _release_backward(self, entry: ParamEntry) -> None:
        count = self.backward_holds.pop(entry, 0)
        for _ in range(count):
            self.placement.release(entry)

    def _queue_end_of_backward(self) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for entry in list(self.backward_holds):
            self._release_backward(entry)
