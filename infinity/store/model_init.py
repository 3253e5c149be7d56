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
to scratch. Transformers is not imported: the model is recognised by what it exposes.

peft's LoRA adapters are not the model's: ``get_peft_model`` adds them to a model already built
and initialises them itself (``LoraLayer.update_layer``: ``lora_A`` and ``lora_B`` built as
``nn.Linear`` layers, then ``reset_lora_parameters(adapter, init_lora_weights)``: A drawn as
peft draws it, B zeros, so the adapted model starts as its base; then cast to the base layer's
dtype). On a base on the meta device peft moves the adapters there too, and their values are
lost. Attach leaves them out of the model's replay and replays peft's own sequence for them
(:func:`initialise_adapters`), layer after layer in the order peft adds them, with the option of
their ``LoraConfig`` (``init_lora_weights``: True, ``"gaussian"`` or False; one computed from the
base weights or from data is an error). peft drew its values from the global generator when it
added them, so the replay draws from a copy of the generator's state after the model's replay
(before it for a model without ``_init_weights``, whose modules' ``reset_parameters()`` attach
runs last) and leaves the global generator as it was. Attach then makes the draws the normal
build makes and no others, and with the generator at the state peft started from (seeded
again before attach), the adapters get peft's values bit for bit. peft is not imported either:
a LoRA layer is a module with ``reset_lora_parameters`` and a ``lora_A`` module dict."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infinity.errors import AttachError

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


def construction_steps(model: nn.Module, skip: frozenset[int] = frozenset()) -> list[Step]:
    """The initialisation steps of ``model``'s meta-device modules in the order its constructor
    runs them: children before their parent, each model's ``_init_weights`` over its own
    modules (those no inner model did) when its construction ends. Modules whose ids are in
    ``skip`` (peft's adapters, added after the build) have none."""
    steps: list[Step] = []
    inited: set[int] = set(skip)
    visited: set[int] = set()

    def build(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in visited:
                visited.add(id(child))
                build(child)
        if (
            id(module) not in skip
            and _has_meta(module)
            and callable(getattr(module, "reset_parameters", None))
        ):
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
    this does not reach stay on the meta device for the caller, peft's LoRA adapters among them
    (:func:`initialise_adapters`)."""
    skip = frozenset(id(m) for adapter in lora_adapters(model) for m in adapter.modules)
    steps = construction_steps(model, skip)
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


def _param(module: nn.Module, name: str) -> nn.Parameter:
    param = module._parameters[name]
    assert param is not None  # only set parameters are named here
    return param


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """peft's LoRA layers (``LoraLayer``) of ``model`` with their names."""
    for name, module in model.named_modules():
        if callable(getattr(module, "reset_lora_parameters", None)) and isinstance(
            getattr(module, "lora_A", None), nn.ModuleDict
        ):
            yield name, module


def _lora_options(model: nn.Module) -> dict[str, object]:
    """Each adapter's ``init_lora_weights``, from the ``peft_config`` a ``PeftModel`` (and the
    tuner model inside it) keeps, in the order the adapters were added."""
    options: dict[str, object] = {}
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict):
            for name, config in configs.items():
                options.setdefault(name, getattr(config, "init_lora_weights", True))
    return options


def _base_dtype(layer: nn.Module) -> torch.dtype | None:
    """The floating dtype of a LoRA layer's base layer's weights, None if it has none."""
    get_base = getattr(layer, "get_base_layer", None)
    base = get_base() if callable(get_base) else None
    for name in ("weight", "qweight"):  # where peft looks
        weight = getattr(base, name, None)
        if isinstance(weight, torch.Tensor):
            return weight.dtype if weight.is_floating_point() else None
    return None


def _replayable(init: object) -> bool:
    """Whether ``init_lora_weights`` is one ``reset_lora_parameters`` draws without the base
    weights or data (peft's default, ``"gaussian"``, or no initialisation)."""
    return init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of one peft layer with parameters on the meta device, as peft builds it:
    ``built``, the modules it constructs (``lora_A``, ``lora_B``: their ``reset_parameters()``
    draws), then ``randn``, the parameters it draws with ``torch.randn`` (an embedding's),
    then ``reset_lora_parameters(name, init)`` unless ``init`` is False."""

    layer: nn.Module
    name: str
    init: object
    configured: bool  # False: no peft_config names it, peft's default ``init`` taken
    built: tuple[nn.Module, ...]
    randn: tuple[tuple[nn.Module, str], ...]
    #: the base layer's floating dtype, which peft casts the adapter to after initialising it
    #: (and ``autocast_adapter_dtype`` back to float32 from bfloat16 or float16)
    cast: torch.dtype | None

    @property
    def parts(self) -> list[tuple[nn.Module, str]]:
        """(module, parameter name) of each of its parameters."""
        own = [(m, n) for b in self.built for m in b.modules() for n in m._parameters]
        return [(m, n) for m, n in own if m._parameters[n] is not None] + list(self.randn)

    @property
    def modules(self) -> list[nn.Module]:
        """The modules holding its parameters."""
        return [m for m, _ in self.parts]


def lora_adapters(model: nn.Module) -> list[Adapter]:
    """``model``'s peft LoRA adapters with parameters on the meta device, in the order peft adds
    them (adapter by adapter, each over the layers in module order). An initialisation attach
    cannot replay on empty weights (one computed from the base weights or from data, DoRA's
    magnitudes) is an ``AttachError``."""
    options = _lora_options(model)
    found: dict[str, list[Adapter]] = {name: [] for name in options}
    for path, layer in _lora_layers(model):
        dicts = [getattr(layer, n, None) for n in ("lora_embedding_A", "lora_embedding_B")]
        lora_a = layer.lora_A
        assert isinstance(lora_a, nn.ModuleDict)  # what _lora_layers found
        names = [*lora_a.keys(), *(k for d in dicts if isinstance(d, nn.ParameterDict) for k in d)]
        for name in dict.fromkeys(names):
            built = tuple(
                getattr(layer, n)[name]
                for n in ("lora_A", "lora_B")
                if isinstance(getattr(layer, n, None), nn.ModuleDict) and name in getattr(layer, n)
            )
            randn = tuple((d, name) for d in dicts if isinstance(d, nn.ParameterDict) and name in d)
            init = options.get(name, True)
            adapter = Adapter(layer, name, init, name in options, built, randn, _base_dtype(layer))
            if not any(_param(m, n).is_meta for m, n in adapter.parts):
                continue
            variant = getattr(layer, "lora_variant", {}).get(name)
            if not _replayable(adapter.init) or variant is not None:
                what = (
                    f"init_lora_weights={adapter.init!r}"
                    if variant is None
                    else f"a {type(variant).__name__} adapter"
                )
                raise AttachError(
                    f"LoRA adapter '{name}' of '{path}' is on the meta device, and its "
                    f"initialisation ({what}) is computed from the base weights or from data, "
                    "which a model on empty weights does not have at attach: use "
                    "init_lora_weights=True or 'gaussian' (peft draws those, and attach replays "
                    "them), apply get_peft_model to the model with its weights loaded, or attach "
                    "with initialise=False and load the adapter's weights with the base's "
                    "(load_pretrained, load_state_dict)"
                )
            found.setdefault(name, []).append(adapter)
    return [adapter for adapters in found.values() for adapter in adapters]


@contextmanager
def _drawn_in(parts: list[tuple[nn.Module, str]]) -> Iterator[list[torch.Tensor]]:
    """The parameters ``parts`` replaced for the block by scratch tensors in the dtype peft builds
    adapters in (torch's default; it casts them to the base layer's dtype after), the originals
    back after it; the list yielded holds the scratch values once the block is done."""
    saved = [(module, name, module._parameters[name]) for module, name in parts]
    values: list[torch.Tensor] = []
    try:
        for module, name, param in saved:
            assert param is not None
            dtype = torch.get_default_dtype() if param.is_floating_point() else param.dtype
            module._parameters[name] = nn.Parameter(
                torch.empty(param.shape, dtype=dtype), requires_grad=param.requires_grad
            )
        yield values
        values.extend(_param(module, name).detach() for module, name, _ in saved)
    finally:
        for module, name, param in saved:
            module._parameters[name] = param


def initialise_adapters(
    model: nn.Module,
    materialise: Callable[[nn.Module, str], nn.Parameter],
    take: Callable[[nn.Parameter], None],
) -> None:
    """Gives ``model``'s peft LoRA adapters on the meta device peft's own initialisation (see the
    module's docstring), drawn from a copy of torch's generator state, which stays as it was;
    ``materialise`` and ``take`` as for :func:`initialise_as_built`, which leaves them out."""
    state = torch.get_rng_state()
    unconfigured: set[str] = set()
    for adapter in lora_adapters(model):
        if not adapter.configured and adapter.name not in unconfigured:
            unconfigured.add(adapter.name)
            log.warning(
                "LoRA adapter '%s' has no peft_config in the attached model (attach the "
                "PeftModel itself to use its LoraConfig): peft's default initialisation "
                "(init_lora_weights=True) replayed",
                adapter.name,
            )
        parts = adapter.parts
        with _drawing_from(state), _drawn_in(parts) as values, torch.no_grad():
            for module in adapter.built:
                module.reset_parameters()  # type: ignore[operator]
            for module, name in adapter.randn:
                _param(module, name).normal_()
            if adapter.init is not False:
                layer: Any = adapter.layer  # a peft LoraLayer
                layer.reset_lora_parameters(adapter.name, adapter.init)
            state = torch.get_rng_state()
        for (module, name), value in zip(parts, values, strict=True):
            param = module._parameters[name]
            if param is not None and param.is_meta:  # one shared by layers: its first values
                real = materialise(module, name)
                with torch.no_grad():
                    real.copy_(value if adapter.cast is None else value.to(adapter.cast))
                take(real)
