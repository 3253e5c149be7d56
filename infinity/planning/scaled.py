"""Planning a model too large to run here.

A model with more parameters than can be trained here is planned from a scaled-down copy (fewer
layers, narrower if need be): the copy's recorded events are repeated for each layer of the full
model, renamed to it, and each event's compute seconds scaled by the ratio of the full module's
matmul FLOPs to the copy's (2 x weights x tokens for a linear layer: the weights' ratio at the same
batch shape). infinity/cli/plan.py builds the copy; these functions only need both module trees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from infinity.core.trace import FORWARD, Event, Trace
from infinity.planning.planner import PlanError, Recording, tree_with


def module_table(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, entry indices) of each module a store attached to ``model`` gathers for, in its
    module order: the ``Event.module`` and ``Event.entries`` numbering (entries in
    ``named_parameters()`` order, modules in ``modules()`` order, as ``TieredStore.attach``)."""
    from infinity.training.hooks import SUBTREE_MODULES

    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    table = []
    for name, module in model.named_modules():
        entries = [index[id(p)] for _, p in module.named_parameters(recurse=False)]
        if isinstance(module, SUBTREE_MODULES):
            entries += [index[id(p)] for p in module.parameters()]
        entries = list(dict.fromkeys(entries))
        if entries:
            table.append((name or type(module).__name__, tuple(entries)))
    return table


def layer_containers(small: nn.Module, full: nn.Module) -> dict[str, tuple[int, int]]:
    """The ``nn.ModuleList`` paths whose length differs between ``small`` and ``full``
    (``model.layers``: 2 and 80), with the two lengths: the layers a scaled copy dropped."""
    lists = {
        name: len(m)
        for name, m in small.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)
    }
    out = {}
    for name, module in full.named_modules():
        if (
            isinstance(module, (nn.ModuleList, nn.Sequential))
            and name in lists
            and len(module) != lists[name]
        ):
            out[name] = (lists[name], len(module))
    return out


def flops_ratio(small: nn.Module, full: nn.Module) -> float:
    """How much more compute ``full``'s forward and backward take than ``small``'s at the same
    batch shape: the ratio of their own weights' elements, which is the matmul FLOPs ratio of
    a linear layer (2 x weights x tokens) and the width ratio of a norm's elementwise work. An
    embedding is a lookup: its work grows with the width, not the vocabulary."""
    if isinstance(small, nn.Embedding) and isinstance(full, nn.Embedding):
        return full.embedding_dim / small.embedding_dim
    size_small = sum(p.numel() for p in small.parameters(recurse=False))
    size_full = sum(p.numel() for p in full.parameters(recurse=False))
    return size_full / size_small if size_small else 1.0


def _layer_key(name: str, containers: dict[str, tuple[int, int]]) -> tuple[str, int, str] | None:
    """(container, layer, name within the layer) when ``name`` is inside a dropped-layer
    container; the longest container path wins (nested stacks)."""
    best = None
    for container in containers:
        prefix = container + "." if container else ""  # "": the root is the stack
        if name.startswith(prefix):
            head, _, rest = name[len(prefix) :].partition(".")
            if head.isdigit() and (best is None or len(container) > len(best[0])):
                best = (container, int(head), rest)
    return best


def _in_layer(container: str, layer: int, rest: str) -> str:
    return (f"{container}.{layer}" if container else str(layer)) + (f".{rest}" if rest else "")


def recording_for_scaled(
    small_model: nn.Module, small: Recording, full_model: nn.Module, flops: Any = flops_ratio
) -> Recording:
    """The recording ``full_model`` (e.g. on the meta device) would give, from ``small``, the
    recording of a scaled-down copy ``small_model`` with fewer layers in its layer stacks and
    possibly narrower modules, but the same module names otherwise and the same batch shape.

    Each run of layer events in the copy's trace (forward: layer 0, 1, ...; backward: the
    reverse) becomes the full model's layers in the same direction, each with the copy's
    per-layer events (and the gradients completed between them) renamed to it; the compute
    seconds of each event are the mean over the copy's layers at that position, times
    ``flops(small_module, full_module)``. Entry and module indices are those of a store
    attached to ``full_model`` (:func:`module_table`). The optimizer's seconds per element,
    the copy rate and the base RSS are the copy's."""
    containers = layer_containers(small_model, full_model)
    small_table = module_table(small_model)
    full_table = module_table(full_model)
    full_module_index = {name: i for i, (name, _) in enumerate(full_table)}
    small_names = [name for name, _ in small_model.named_parameters()]
    full_entry = {name: i for i, (name, _) in enumerate(full_model.named_parameters())}
    small_modules = dict(small_model.named_modules())
    full_modules = dict(full_model.named_modules())
    trace = small.trace
    grads_after: dict[int, list[str]] = {}  # event position -> gradients completed after it
    for observed, index in getattr(trace, "grads", ()):
        grads_after.setdefault(observed - 1, []).append(small_names[index])

    # Segments: consecutive events of one layer (key) or outside any layer (None).
    segments: list[tuple[Any, list[int]]] = []
    for position, event in enumerate(trace.events):
        found = _layer_key(small_table[event.module][0], containers)
        key = (found[0], found[1], event.kind) if found else None
        if segments and key is not None and segments[-1][0] == key:
            segments[-1][1].append(position)
        else:
            segments.append((key, [position]))
    # A stack's layers are its children with parameters, every ``period``-th from ``first``
    # (nn.Sequential(Linear, ReLU, Linear, ReLU, ...): 0, 2, 4, ...).
    stacks: dict[str, tuple[int, int, int, int]] = {}  # first, period, copy's, full's units
    for container, (small_len, full_len) in containers.items():
        used = sorted({key[1] for key, _ in segments if key is not None and key[0] == container})
        if not used:
            continue
        first, period = used[0], (used[1] - used[0] if len(used) > 1 else 1)
        units = (small_len - first + period - 1) // period
        if (
            used != list(range(first, small_len, period))
            or (full_len - first) % period
            and period > 1
        ):
            raise PlanError(
                f"the scaled copy's layers of {container or 'the model'} with "
                f"parameters ({used} of {small_len}) do not repeat evenly: its "
                f"trace cannot be extended to the full model"
            )
        stacks[container] = (first, period, units, (full_len - first + period - 1) // period)

    out = Trace()
    out_compute: list[float] = []
    out_grads: list[tuple[int, int]] = []

    def full_index(name: str) -> int:
        if name not in full_entry:
            raise PlanError(
                f"parameter {name!r} of the scaled copy is not in the full model: "
                f"the copy must keep the full model's parameter names"
            )
        return full_entry[name]

    def emit(
        kind: str,
        small_name: str,
        module_name: str,
        entry_names: list[str],
        grad_names: list[str],
        seconds: float,
    ) -> None:
        if module_name not in full_module_index:
            raise PlanError(
                f"module {module_name!r} of the scaled copy has no counterpart with "
                f"parameters in the full model: the copy must keep the full "
                f"model's module names"
            )
        ratio = flops(
            small_modules[_module_path(small_modules, small_name)],
            full_modules[_module_path(full_modules, module_name)],
        )
        out.append(
            Event(kind, full_module_index[module_name], tuple(full_index(n) for n in entry_names))
        )
        out_compute.append(seconds * ratio)
        out_grads.extend((len(out.events), full_index(n)) for n in grad_names)

    def outside(name: str) -> str:
        """A layer's parameter named from outside the layer stacks (a gradient completed
        there): the copy's first layers are the full model's first, its last the last."""
        found = _layer_key(name, containers)
        if found is None:
            return name
        container, layer, rest = found
        first, period, small_units, full_units = stacks[container]
        if (layer - first) // period >= small_units / 2:
            layer += (full_units - small_units) * period
        return _in_layer(container, layer, rest)

    for observed, index in getattr(trace, "grads", ()):
        if observed == 0:  # completed before the first event (not seen in practice)
            out_grads.append((0, full_index(outside(small_names[index]))))
    i = 0
    while i < len(segments):
        key, positions = segments[i]
        if key is None:
            for position in positions:
                event = trace.events[position]
                name = small_table[event.module][0]
                emit(
                    event.kind,
                    name,
                    name,
                    [small_names[e] for e in event.entries],
                    [outside(n) for n in grads_after.get(position, ())],
                    trace.compute[position],
                )
            i += 1
            continue
        container, _, kind = key
        run = [segments[i]]
        while (
            i + len(run) < len(segments)
            and segments[i + len(run)][0] is not None
            and segments[i + len(run)][0][0] == container
            and segments[i + len(run)][0][2] == kind
        ):
            run.append(segments[i + len(run)])
        i += len(run)
        first, period, small_units, full_units = stacks[container]
        full_len = containers[container][1]
        order = [layer for (_, layer, _), _ in run]
        expected = [first + unit * period for unit in range(small_units)]
        if kind != FORWARD:
            expected.reverse()
        if order != expected:
            raise PlanError(
                f"the scaled copy's {kind} events visit the layers of "
                f"{container or 'the model'} in the order {order}, not one after "
                f"another ({expected}): its trace cannot be extended to "
                f"{full_units} layers"
            )
        # Each layer's events, relative to the layer: alike in every layer, to be repeated.
        shapes = []
        for (_, layer, _), positions in run:
            shape = []
            for position in positions:
                event = trace.events[position]
                name = small_table[event.module][0]
                key = _layer_key(name, containers)
                assert key is not None  # the run's events are in its layers
                shape.append(
                    (
                        event.kind,
                        key[2],
                        tuple(
                            _relative(small_names[e], containers, container, layer)
                            for e in event.entries
                        ),
                        tuple(
                            _relative(n, containers, container, layer)
                            for n in grads_after.get(position, ())
                        ),
                    )
                )
            shapes.append(shape)
        if any(shape != shapes[0] for shape in shapes[1:]):
            raise PlanError(
                f"the scaled copy's layers of {container} do not run the same "
                f"modules in the same order: the full model's layers cannot be "
                f"repeated from them"
            )
        seconds = [
            sum(trace.compute[positions[k]] for _, positions in run) / len(run)
            for k in range(len(shapes[0]))
        ]
        template = run[0][0][1]  # the copy's layer whose modules stand for every layer's
        layers = [first + unit * period for unit in range(full_units)]
        for layer in layers if kind == FORWARD else reversed(layers):
            for (event_kind, rest, entries, grads), spent in zip(shapes[0], seconds):
                emit(
                    event_kind,
                    _in_layer(container, template, rest),
                    _in_layer(container, layer, rest),
                    [_absolute(n, container, layer, full_len) for n in entries],
                    [_absolute(n, container, layer, full_len) for n in grads],
                    spent,
                )

    out.compute = out_compute
    if hasattr(out, "grads"):
        out.grads = out_grads
    # (the copy's attach peak says nothing of how the full model will be built)
    return dataclasses.replace(small, trace=out, attach_peak_rss=0, bounded_base_rss=0)


def _module_path(modules: dict[str, nn.Module], name: str) -> str:
    """``module_table`` names the root module by its type; ``named_modules`` by ''."""
    return name if name in modules else ""


def _relative(
    name: str, containers: dict[str, tuple[int, int]], container: str, layer: int
) -> str | tuple[int, str]:
    """A parameter name relative to ``layer`` of ``container``: (layer offset, name within the
    layer) for one in that stack, the name itself for one outside it (a tied weight)."""
    found = _layer_key(name, containers)
    if found is None or found[0] != container:
        return name
    return (found[1] - layer, found[2])


def _absolute(relative: str | tuple[int, str], container: str, layer: int, layers: int) -> str:
    if isinstance(relative, str):
        return relative
    offset, rest = relative
    if not 0 <= layer + offset < layers:
        raise PlanError(
            f"the scaled copy's layer events of {container} name a parameter "
            f"{offset:+d} layers away, which layer {layer} of {layers} lacks"
        )
    return _in_layer(container, layer + offset, rest)


def skeleton(model: nn.Module, ranks: int = 1) -> nn.Module:
    """``model``'s module tree with only its parameters, on the meta device, in the same order
    (tied parameters stay tied): what :func:`simulate` attaches to. ``ranks`` > 1: each
    parameter is one rank's slice of it under ZeRO-3 (a flat ``ceil(numel / ranks)``), so the
    simulated store holds, moves and updates what one of ``ranks`` data-parallel ranks does;
    the module order and entry indices stay those of the whole model."""
    made: dict[int, nn.Parameter] = {}

    def clone_of(param: nn.Parameter) -> nn.Parameter:
        if id(param) not in made:
            shape = param.shape if ranks == 1 else (-(-param.numel() // ranks),)
            made[id(param)] = nn.Parameter(
                torch.empty(shape, dtype=param.dtype, device="meta"),
                requires_grad=param.requires_grad,
            )
        return made[id(param)]

    return tree_with(model, clone_of)
