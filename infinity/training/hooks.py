"""Module hooks that gather parameters just before a module runs and release them after.

Forward: a pre-hook gathers the module's own parameters onto the device, a post-hook releases
them. Backward: the forward post-hook puts a hook on each output that requires grad; the first of
them to fire (the gradient reached the module's output, so its backward is next) gathers the
parameters again. Each parameter's post-accumulate-grad hook fires once its gradient is complete
for this backward pass (all uses summed); it moves the gradient to the host and drops the
backward holds. Whatever is still held when the backward pass ends (frozen parameters, unused
outputs) is released by a callback queued on the autograd engine.

A graph kept with ``retain_graph=True`` can be run backward again: the output hooks fire once per
backward pass (the end-of-backward callback starts a new pass), not once per forward.

Under ``torch.inference_mode()`` the device copies are still made as normal tensors: they are
cached across iterations, and an inference tensor cached there would fail the next training
forward ("Inference tensors cannot be saved for backward").

A module's forward may use parameters of a child it does not call: ``nn.MultiheadAttention`` passes
``out_proj.weight`` to a functional kernel. Modules of such types gather the parameters of their
whole subtree (``SUBTREE_MODULES``); their children keep their own hooks. (The fused inference fast
path of ``nn.TransformerEncoderLayer`` would be another, but torch turns it off when any submodule
has forward hooks, as every attached one does.) Any other module that reads a child's parameter
without calling the child gets its values read from the store for each op
(``infinity.training.param_access``), which is correct but slower: register the parameter on that
module too (``self.w = self.child.weight``) to have it gathered once.

Frozen parameters get no gradient hook; their backward holds are dropped once the gradients of
the module call's inputs are computed (``_hook_inputs``), or at the end of backward.

A parameter that was frozen at attach and is unfrozen later gets its gradient hook at its next
forward, so its gradients reach the optimizer as they do in plain torch.

A module may return one of its own parameters (a learned query, a positional table): the
returned tensor is then a view of the gathered values, since the parameter itself holds an
empty placeholder again once the module has finished.

Only public hook APIs are used; nothing in torch is patched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from infinity.core.finalizers import raise_pending_interrupt
from infinity.core.shards import ParamEntry, ShardRegistry
from infinity.core.trace import BACKWARD, FORWARD, Event

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


log = logging.getLogger(__name__)

#: modules whose forward uses their descendants' parameters without calling the descendants
SUBTREE_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


class HookSet:
    """Installs and removes the hooks of one attached model."""

    def __init__(
        self,
        store: AttachedStore,
        root: nn.Module,
        module_entries: list[tuple[nn.Module, list[ParamEntry]]],
    ) -> None:
        self.store = store
        placement = store.placement
        assert placement is not None  # installed by attach, after the placement is made
        self.placement = placement
        self.root = root
        self.modules = _with_subtrees(store.registry, root, module_entries)
        self.handles: list[Any] = []
        #: indices of the entries whose parameter has its post-accumulate-grad hook
        self._grad_hooked: set[int] = set()
        #: entries gathered for backward and not yet released: entry -> count
        self.backward_holds: dict[ParamEntry, int] = {}
        self._callback_queued = False
        #: the autograd graph task of the backward pass that queued the callback, if known
        self._pass_task: int | None = None
        #: counts finished backward passes; an output hook fires once per pass
        self._backward_pass = 0
        #: the frozen parameters' input hooks, removed when their pass ends: see _hook_inputs
        self._input_hooks: list[Any] = []
        #: stage 3 across ranks: the gathered copies kept from forward for backward
        self.kept = placement.copies.kept_for_backward

    def install(self) -> None:
        # A function, not the bound method: copy.deepcopy(model) (an EMA copy) copies the
        # modules' hook dicts, and would try to copy a bound method's HookSet with the store.
        hooks = self

        def root_pre_forward(module: nn.Module, args: Any) -> None:
            hooks._root_pre_forward(module, args)

        self.handles.append(self.root.register_forward_pre_hook(_opaque(root_pre_forward)))
        for index, (module, entries) in enumerate(self.modules):
            pre_forward, post_forward = self._make_hooks(index, module, entries)
            self.handles.append(module.register_forward_pre_hook(_opaque(pre_forward)))
            # always_call: activation checkpointing stops a recomputation early by raising out
            # of a module's forward, and the holds taken by its pre-hook must still be released.
            self.handles.append(
                module.register_forward_hook(
                    _opaque(post_forward), always_call=True, with_kwargs=True
                )
            )
        for _, entries in self.modules:
            self._hook_grads(entries)

    def _hook_grads(self, entries: list[ParamEntry]) -> None:
        """Gives each entry whose parameter requires grad its gradient hook, once. Called at
        install and again before each forward: torch cannot hook a parameter that does not
        require grad, so one unfrozen after attach is hooked the first time it runs."""
        for entry in entries:
            if entry.index not in self._grad_hooked and entry.param.requires_grad:
                self._grad_hooked.add(entry.index)
                self.handles.append(
                    entry.param.register_post_accumulate_grad_hook(
                        _opaque(self._make_grad_hook(entry))
                    )
                )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # -- forward ------------------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        # What a finalizer caught (a Ctrl-C, a SIGTERM handler's exit) is raised here, once per
        # forward, outside any finalizer: see core/finalizers.py.
        raise_pending_interrupt()
        if module is not self.root:
            return  # a copy of the model (copy.deepcopy: an EMA model) carries the hooks too
        # A new iteration starts with the root's forward, unless we are inside a backward pass
        # (activation checkpointing re-runs forwards there).
        if self._in_backward():
            return
        if self.backward_holds or self._callback_queued:
            # Outside any backward pass, yet the last one left holds or a callback that never
            # ran: it raised (a hook, an out-of-memory the loop skipped), and the autograd
            # engine drops queued callbacks when a pass fails. Finish it now, or frozen
            # parameters would stay held, no later pass would queue the callback and no later
            # forward would start an iteration.
            self._end_of_backward(finished=False)
        self._drop_kept()  # kept by a forward whose backward never came (evaluation, grad on)
        self._remove_input_hooks()
        self.store.stepping.start_iteration(torch.is_grad_enabled(), module.training)

    def _in_backward(self) -> bool:
        task = _graph_task()
        if task is None:  # not in this torch: judge by the holds, as far as they tell
            return bool(self.backward_holds)
        return task != -1

    def _make_hooks(
        self, index: int, owner: nn.Module, entries: list[ParamEntry]
    ) -> tuple[Callable, Callable]:
        forward_event = Event(FORWARD, index, tuple(e.index for e in entries))
        backward_event = Event(BACKWARD, index, tuple(e.index for e in entries))
        # What each call under way gathered, innermost last (a module may run inside its own
        # forward). The post-hook releases exactly that: when a gather fails (BudgetError) the
        # always_call post-hook still runs, and must not release what was never gathered, nor
        # take a hold some other use of a shared parameter holds.
        calls: list[list[ParamEntry]] = []

        def pre_forward(module: nn.Module, args: Any) -> None:
            if module is not owner:
                return  # a deep copy of the module: its parameters are its own, plain ones
            self._hook_grads(entries)
            gathered: list[ParamEntry] = []
            calls.append(gathered)
            # Read before leaving inference mode, which turns grad mode back on.
            lend = not torch.is_grad_enabled()
            with _normal_tensors():
                # Prefetch makes host views of the arena too: normal tensors, which training
                # writes into later (and a lent device copy is one of them).
                self.placement.on_event(forward_event)
                for entry in entries:
                    self.placement.gather(entry, lend=lend)
                    gathered.append(entry)
                self._computing(gathered, True)
                self.placement.assemble_ahead()
            self.store.checkpoint_progress()
            self.store.watch_heap()

        def post_forward(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            if module is not owner:
                return None
            flat, spec = tree_flatten(output)
            replaced = _alias_returned_params(flat, spec, entries)
            if replaced is not None:
                output = replaced
                flat = tree_flatten(output)[0]
            gathered = calls.pop() if calls else []
            kept: set[ParamEntry] = set()
            if self.kept is not None and torch.is_grad_enabled() and not self._in_backward():
                kept = self.kept.keep(index, gathered, self.placement.follower.trace)
            with _normal_tensors():
                for entry in gathered:
                    if entry not in kept:
                        self._release(entry)
            if not torch.is_grad_enabled() and self.placement.prefetching.inference_iteration_over:
                with _normal_tensors():
                    self.placement.prefetching.prefetch_ahead()
            if torch.is_grad_enabled():
                self._hook_outputs(flat, backward_event, entries)
                self._hook_inputs((args, kwargs), entries)
            return replaced

        return pre_forward, post_forward

    # -- backward -----------------------------------------------------------------------------
    def _hook_outputs(self, flat: list[Any], event: Event, entries: list[ParamEntry]) -> None:
        tensors = [
            t
            for t in flat
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        ]
        if not tensors:
            return
        # The backward pass in which this module's parameters were last gathered: the first of
        # its outputs to get a gradient gathers them; the others of the same pass do nothing. A
        # flag set once would leave a second backward over a retained graph with placeholders.
        fired = [-1]

        def pre_backward(grad: torch.Tensor) -> None:
            if fired[0] == self._backward_pass:
                return
            fired[0] = self._backward_pass
            self._queue_end_of_backward()
            self.placement.on_event(event)
            for entry in entries:
                self.placement.gather(entry)
                self.backward_holds[entry] = self.backward_holds.get(entry, 0) + 1
            if self.kept is not None:
                # the holds forward kept go with this backward's (dropped with them)
                for entry, count in self.kept.take(entries).items():
                    self.backward_holds[entry] += count
            self._computing(entries, True)
            self.placement.assemble_ahead()
            self.store.watch_heap()

        for tensor in tensors:
            tensor.register_hook(_opaque(pre_backward))

    def _hook_inputs(self, inputs: Any, entries: list[ParamEntry]) -> None:
        """Frozen parameters get no gradient hook to drop their backward holds; without this
        they would stay on the device until the whole backward pass ends (a LoRA model's base
        weights: the whole model). Once the gradients of every input of this call are
        computed, the module's backward no longer needs them: drop one hold each."""
        frozen = [e for e in entries if not e.param.requires_grad]
        if not frozen:
            return
        tensors = [
            t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not tensors:
            return  # the end-of-backward callback releases them

        def inputs_done(grads: Any) -> None:
            for entry in frozen:
                count = self.backward_holds.get(entry, 0)
                if count:
                    if count == 1:
                        del self.backward_holds[entry]
                    else:
                        self.backward_holds[entry] = count - 1
                    self._release(entry)

        # The hook keeps the grad_fns of its inputs in a closure that those grad_fns hold back
        # through their own hooks: a cycle through C++ that Python's collector cannot see.
        # With activation checkpointing it kept each step's recomputed graph alive (peak RSS
        # grew with every step), so the hooks are removed when their backward pass ends, or
        # when the next iteration starts without one.
        self._input_hooks.append(
            torch.autograd.graph.register_multi_grad_hook(tensors, _opaque(inputs_done), mode="all")
        )

    def _remove_input_hooks(self) -> None:
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks.clear()

    def _make_grad_hook(self, entry: ParamEntry) -> Callable:
        def grad_ready(param: torch.Tensor) -> None:
            # The gradient autograd left, not the store's view of it
            # (infinity.training.param_access).
            with torch._C.DisableTorchFunctionSubclass():
                grad = param.grad
                if grad is not None:
                    param.grad = None  # first: a refused gradient must not stay to be added to
            self.placement.follower.grad_ready(entry.index)
            if grad is not None:
                self.store.stepping.grad_arriving(entry)
                self.placement.gradients.take_grad(
                    entry,
                    grad,
                    report=self.placement.update_in_backward,
                    nested=self._nested_backward(),
                )
            self._release_backward(entry)
            self._update_completed()

        return grad_ready

    def _update_completed(self) -> None:
        """With updates in backward: updates the entries whose gradients are complete (in one
        process the one just taken; across ranks those whose reductions have landed)."""
        for entry, nested in self.placement.gradients.completed():
            # Checked for each: an update that found no room sends the rest to the step.
            if self.placement.update_in_backward:
                self.store.stepping.grad_complete(entry, nested=nested)

    @property
    def backward_passes(self) -> int:
        """Outermost backward passes finished since attach."""
        return self._backward_pass

    def backward_pass_finished(self) -> None:
        """What autograd's end-of-backward callback does, for a replay without autograd (the
        planner's simulation)."""
        self._end_of_backward()

    def _nested_backward(self) -> bool:
        """Whether this runs in a backward pass started inside the pass that queued the
        end-of-backward callback (reentrant activation checkpointing), where a gradient may
        still be partial."""
        return self._pass_task is not None and _graph_task() != self._pass_task

    def _drop_kept(self) -> None:
        if self.kept is not None:
            for entry, count in self.kept.drain().items():
                for _ in range(count):
                    self._release(entry)

    def _release_backward(self, entry: ParamEntry) -> None:
        count = self.backward_holds.pop(entry, 0)
        for _ in range(count):
            self._release(entry)

    def _release(self, entry: ParamEntry) -> None:
        self.placement.release(entry)
        if not entry.holds:
            self._computing([entry], False)

    def _computing(self, entries: list[ParamEntry], live: bool) -> None:
        """See ParamAccess.computing (the access exists once attach has finished)."""
        access = self.store.access
        if access is not None:
            access.computing(entries, live)

    def _queue_end_of_backward(self) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        self._pass_task = _graph_task()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self, finished: bool = True) -> None:
        # Across ranks, the gradient reductions still under way complete now: the loop reads
        # gradients after backward (clipping, norms) and the step consumes them.
        self.placement.gradients.finish_reductions()
        # The allocator's reserved memory against the device budget (CUDA; logs once).
        self.placement.device.check_reserved()
        self._callback_queued = False
        self._pass_task = None
        self._backward_pass += 1
        for entry in list(self.backward_holds):
            self._release_backward(entry)
        self._drop_kept()  # modules whose outputs got no gradient in this pass
        self._remove_input_hooks()
        if finished:
            self._update_completed()  # those whose reductions landed last
        else:
            self.placement.gradients.completed()  # a pass that raised: left to the step


def _opaque(hook: Callable) -> Callable:
    """``hook`` run as Python, never traced by torch.compile: it moves bytes between the tiers
    and keeps the store's books, which a compiled graph would freeze (a graph break)."""
    return torch.compiler.disable(hook, recursive=True)


def _graph_task() -> int | None:
    """The id of the backward pass running on this thread, -1 outside one; None where this
    torch does not tell. torch's own register_multi_grad_hook reads it the same way."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else None


def _normal_tensors() -> contextlib.AbstractContextManager:
    """Leaves inference mode while device copies and placeholders are made (see the module
    docstring); a no-op outside it."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _with_subtrees(
    registry: ShardRegistry,
    root: nn.Module,
    module_entries: list[tuple[nn.Module, list[ParamEntry]]],
) -> list[tuple[nn.Module, list[ParamEntry]]]:
    """``module_entries`` (each module's own parameters, in ``root.modules()`` order) with the
    modules of ``SUBTREE_MODULES`` also needing every parameter below them."""
    own = {id(module): entries for module, entries in module_entries}
    out = []
    for module in root.modules():
        entries = list(own.get(id(module), ()))
        if isinstance(module, SUBTREE_MODULES):
            for param in module.parameters():
                entry = registry.entry_of(param)
                if entry is not None and entry not in entries:
                    entries.append(entry)
        if entries:
            out.append((module, entries))
    return out


def _alias_returned_params(flat: list[Any], spec: Any, entries: list[ParamEntry]) -> Any:
    """The output (flattened as ``flat``, ``spec``) with each of the module's own parameters in
    it replaced by a copy of its gathered values (autograd still reaches the parameter through
    the copy, and the copy outlives an eviction of the device bytes); None when the output holds
    none of them, which is nearly always."""
    params = {id(entry.param) for entry in entries}
    if not any(isinstance(t, torch.Tensor) and id(t) in params for t in flat):
        return None
    return tree_unflatten(
        [t.clone() if isinstance(t, torch.Tensor) and id(t) in params else t for t in flat], spec
    )
