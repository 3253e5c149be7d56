"""A meta-built model's parameters initialised as its own constructor would have made them.

A model that exposes ``_init_weights(module)`` (every Hugging Face ``PreTrainedModel``, and
models written in its style) is initialised by its constructor in two rounds: each module's
``reset_parameters()`` as the module is built, then, once the model's modules are all built,
``_init_weights`` over them in post-order (``post_init``; a model nested inside another, as
``LlamaModel`` inside ``LlamaForCausalLM``, runs its own at the end of its own constructor, and
the outer one skips what it did). Its norms (``LlamaRMSNorm``) have no ``reset_parameters()``:
only ``_init_weights`` gives them values.

Attach replays the same sequence of draws from torch's global generator, so the same seed gives
the same values as the model built normally, one module materialised at a time: every
``reset_parameters()`` draws into scratch tensors in construction order, its generator state
kept; at a module's ``_init_weights`` step its parameters are materialised, refilled from that
state (what construction left there), and then given to ``_init_weights``, which overwrites what
it initialises and draws what the normal build draws there. What differs from the normal build:
draws a constructor makes outside ``reset_parameters()`` and ``_init_weights`` (a
``torch.randn`` in an ``__init__``), and initialisation a model does after ``post_init`` by name
(nanoGPT's scaled projections), are not replayed. A parameter two modules share (tied
embeddings) keeps the values of the first module to initialise it, as the normal build ties
the output embedding to the input one after initialising both: the second module's draws go
to scratch. Transformers is not imported: the model is recognised by what it exposes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger("infinity.store")

#: ("reset" | "init", the module, the model's ``_init_weights`` for an "init" step)
Step = tuple[str, nn.Module, Callable[[nn.Module], object] | None]


def _has_meta(module: nn.Module) -> bool:
    return any(p is not None and p.is_meta for p in module._parameters.values())


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    if id(module) not in seen:
        seen.add(id(module))
        yield module


def model_init_of(model: nn.Module) -> bool:
    """Whether some module of ``model`` initialises its modules itself (``_init_weights``)."""
    return any(callable(getattr(m, "_init_weights", None)) for m in model.modules())


def construction_steps(model: nn.Module) -> list[Step]:
    """The initialisation steps of ``model``'s meta-device modules in the order its constructor
    runs them: children before their parent, each model's ``_init_weights`` over its own
    modules (those no inner model did) when its construction ends."""
    steps: list[Step] = []
    inited: set[int] = set()
    visited: set[int] = set()

    def build(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in visited:
                visited.add(id(child))
                build(child)
        if _has_meta(module) and callable(getattr(module, "reset_parameters", None)):
            steps.append(("reset", module, None))
        init = getattr(module, "_init_weights", None)
        if callable(init):
            for sub in _post_order(module, set()):
                if id(sub) not in inited and _has_meta(sub):
                    inited.add(id(sub))
                    steps.append(("init", sub, init))

    visited.add(id(model))
    build(model)
    return steps


@contextmanager
def _scratch(module: nn.Module, names: list[str]) -> Iterator[None]:
    """``module``'s parameters ``names`` replaced by throwaway tensors of their shape and dtype
    for the block, so an initialiser can draw into them; the originals back after it."""
    saved = {name: module._parameters[name] for name in names}
    try:
        for name, param in saved.items():
            assert param is not None
            module._parameters[name] = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad
            )
        yield
    finally:
        module._parameters.update(saved)


@contextmanager
def _drawing_from(state: torch.Tensor) -> Iterator[None]:
    """torch's CPU generator at ``state`` for the block, back where it was after it."""
    now = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(now)


def initialise_as_built(
    model: nn.Module,
    materialise: Callable[[nn.Module, str], nn.Parameter],
    take: Callable[[nn.Parameter], None],
    leave_empty: Callable[[nn.Parameter], None],
) -> None:
    """Initialises ``model``'s meta-device parameters as its constructor would (see the module's
    docstring). ``materialise(module, name)`` gives a meta parameter its real (uninitialised)
    tensor wherever the model refers to it; ``take(param)`` moves its values into the store;
    ``leave_empty(param)`` leaves one nothing initialised without values. Parameters of modules
    this does not reach stay on the meta device for the caller."""
    steps = construction_steps(model)
    built: dict[int, torch.Tensor] = {}  # a module's generator state at its reset_parameters()
    done: set[int] = set()  # parameters materialised here, by id
    for kind, module, init in steps:
        own = [name for name, p in module._parameters.items() if p is not None]
        if kind == "reset":
            built[id(module)] = torch.get_rng_state()
            with _scratch(module, own), torch.no_grad():
                module.reset_parameters()  # type: ignore[operator]
            continue
        assert init is not None
        fresh = [
            name
            for name in own
            if module._parameters[name].is_meta  # type: ignore[union-attr]
            and id(module._parameters[name]) not in done
        ]
        others = [name for name in own if name not in fresh]
        for name in fresh:
            real = materialise(module, name)
            done.add(id(real))
            if id(module) not in built and real.is_floating_point():
                with torch.no_grad():
                    real.fill_(float("nan"))  # what nothing initialises shows as NaN
        with _scratch(module, others), torch.no_grad():
            if id(module) in built:
                with _drawing_from(built[id(module)]):
                    module.reset_parameters()  # type: ignore[operator]
            init(module)
        for name in fresh:
            param = module._parameters[name]
            assert param is not None
            if id(module) in built or not (param.is_floating_point() and param.isnan().any()):
                take(param)
            else:
                log.debug(
                    "module %s: '%s' left without values by the model's _init_weights",
                    type(module).__name__,
                    name,
                )
                leave_empty(param)
    # Modules outside every model that initialises its own: their reset_parameters() values.
    for _, module, _ in (s for s in steps if s[0] == "reset"):
        fresh = [
            name
            for name, p in module._parameters.items()
            if p is not None and p.is_meta and id(p) not in done
        ]
        if not fresh:
            continue
        reals = [materialise(module, name) for name in fresh]
        done.update(id(r) for r in reals)
        others = [n for n, p in module._parameters.items() if p is not None and n not in fresh]
        with _scratch(module, others), torch.no_grad(), _drawing_from(built[id(module)]):
            module.reset_parameters()  # type: ignore[operator]
        for real in reals:
            take(real)
