"""infinity-plan's models: how to build one (a Hugging Face config or a module and its
arguments; whole, scaled down, or on the meta device), feed it a training step, and record that
step through a store (infinity/cli/plan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from infinity import OffloadConfig, TieredStore
from infinity.cli.common import contention
from infinity.cli.common.args import UserError
from infinity.config import ALIGNMENT
from infinity.planning import planner
from infinity.planning.planner import Recording
from infinity.planning.simulated_time import Contention

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}
LAYER_KEYS = ("layers", "num_layers", "n_layers", "n_layer", "num_hidden_layers", "depth")
WIDTH_KEYS = ("width", "hidden", "hidden_size", "d_model", "dim", "n_embd")
#: the smallest swap buffer a recording uses
MIN_BUFFER = 64 << 10


@dataclass
class ModelSource:
    """How to build the model (whole or scaled down, on the CPU or the meta device) and feed it
    one training step."""

    label: str
    build: Callable[[dict[str, Any], bool], nn.Module]  # (changes, meta) -> model
    inputs: str  # hf (input_ids, labels -> .loss), tokens, features
    layer_keys: tuple[str, ...]  # the arguments that set the number of layers
    width_keys: tuple[str, ...]  # the arguments narrowed in a narrower copy
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # --module's arguments

    def make(self, changes: dict[str, Any] | None = None, meta: bool = False) -> nn.Module:
        try:
            return self.build(changes or {}, meta)
        except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
            what = f" with {changes}" if changes else ""
            raise UserError(
                f"{self.label}: the model cannot be built{what}: {type(exc).__name__}: {exc}"
            ) from None


def quiet_transformers() -> None:
    """Hugging Face's own messages at error level only (when it is installed)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


def hf_source(path: Path) -> ModelSource:
    if not path.exists():
        raise UserError(
            f"--hf-config {path} does not exist: pass a Hugging Face model "
            f"directory (with config.json) or a config.json file"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"--hf-config {path} holds no config.json")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError(
            "--hf-config needs transformers: pip install 'infinity-offload[hf]'"
        ) from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"--hf-config {path} cannot be read as a Hugging Face config: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def build(changes: dict[str, Any], meta: bool) -> nn.Module:
        copy = type(config).from_dict(config.to_dict())
        target = copy.get_text_config() if hasattr(copy, "get_text_config") else copy
        for key, value in changes.items():
            setattr(target, key, value)
        with torch.device("meta" if meta else "cpu"):
            model = AutoModelForCausalLM.from_config(copy, dtype=torch.float32)
        return model

    widths = tuple(
        k
        for k in ("hidden_size", "intermediate_size", "n_inner", "ffn_dim")
        if getattr(text, k, None) is not None
    )
    return ModelSource(
        f"{type(config).__name__} ({path})", build, "hf", ("num_hidden_layers",), widths
    )


def module_source(spec: str, args_text: str) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(
            f"--module {spec!r}: expected pkg.mod:Callable, "
            "e.g. infinity.cli.common.tiny_gpt:TinyGPT"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"--module {spec}: {exc}") from None
    try:
        args = json.loads(args_text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--args is not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(args, dict):
        raise UserError(f"--args must be a JSON object of keyword arguments, got {args_text!r}")
    holder = _dataclass_argument(factory, args)

    def build(changes: dict[str, Any], meta: bool) -> nn.Module:
        kwargs = {**args, **changes}
        with torch.device("meta" if meta else "cpu"):
            model = factory(holder[1](**kwargs)) if holder else factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{spec} returned a {type(model).__name__}, not an nn.Module")
        return model

    values = dict(args)
    if holder:
        values = {
            f.name: f.default
            for f in dataclasses.fields(holder[1])
            if f.default is not dataclasses.MISSING
        } | values
    else:
        values = {
            name: p.default
            for name, p in _parameters(factory).items()
            if p.default is not inspect.Parameter.empty
        } | values
    model = ModelSource(spec, build, "features", (), ()).make(meta=True)
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    return ModelSource(
        spec,
        build,
        "tokens" if isinstance(first, nn.Embedding) else "features",
        tuple(k for k in LAYER_KEYS if isinstance(values.get(k), int)),
        tuple(k for k in WIDTH_KEYS if isinstance(values.get(k), int)),
        values,
    )


def _parameters(factory: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return {}


def _dataclass_argument(factory: Any, args: dict[str, Any]) -> tuple[str, Any] | None:
    """(name, class) of ``factory``'s one dataclass parameter, when ``args`` are that
    dataclass's fields rather than the factory's own arguments (TinyGPT(GPTConfig(...)))."""
    try:
        params = list(inspect.signature(factory).parameters.values())
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except (TypeError, ValueError, NameError):
        return None
    if len(params) != 1 or (args and set(args) <= {params[0].name}):
        return None
    hint = hints.get(params[0].name)
    return (params[0].name, hint) if dataclasses.is_dataclass(hint) else None


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def scaled_changes(
    source: ModelSource, full: nn.Module, layers: int, limit: float
) -> tuple[dict[str, Any], int]:
    """The argument changes of a scaled-down copy: ``layers`` per layer stack, and the widths
    halved until it has at most ``limit`` parameters; with its parameter count."""
    if not source.layer_keys:
        raise UserError(
            f"{source.label}: no argument sets its number of layers (one of "
            f"{', '.join(LAYER_KEYS)}), so no scaled-down copy can be built: run it "
            f"whole with a higher --max-local-params"
        )
    base = {key: layers for key in source.layer_keys}
    text = _text_config(full)
    for factor in (1, 2, 4, 8, 16, 32, 64):
        changes = dict(base)
        if factor > 1:
            if not source.width_keys:
                break
            changes.update(_narrowed(source, text, factor))
        small = source.make(changes, meta=True)
        count = parameter_count(small)
        if count <= limit:
            return changes, count
    raise UserError(
        f"{source.label}: even a {layers}-layer copy narrowed 64x has more than "
        f"--max-local-params {limit:.0f} parameters: raise it"
    )


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _narrowed(source: ModelSource, config: Any, factor: int) -> dict[str, Any]:
    """Widths divided by ``factor``; attention keeps its head size with fewer heads (key/value
    heads too, dividing the query heads), as a smaller model of the family would."""
    if config is None:  # a --module model: its width arguments
        return {key: max(1, source.values[key] // factor) for key in source.width_keys}
    heads = getattr(config, "num_attention_heads", None)
    hidden = config.hidden_size
    changes: dict[str, Any] = {}
    if heads:
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        new_heads = max(1, heads // factor)
        changes["num_attention_heads"] = new_heads
        changes["hidden_size"] = new_heads * head_dim
        if getattr(config, "head_dim", None):
            changes["head_dim"] = head_dim
        kv = getattr(config, "num_key_value_heads", None)
        if kv:
            new_kv = max(1, kv // factor)
            changes["num_key_value_heads"] = math.gcd(new_kv, new_heads)
    else:
        changes["hidden_size"] = max(1, hidden // factor)
    for key in ("intermediate_size", "n_inner", "ffn_dim"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            changes[key] = max(1, value // factor)
    return changes


# ---------------------------------------------------------------------------- recording


def inputs_for(
    source: ModelSource,
    model: nn.Module,
    batch: int,
    seq_len: int | None,
    generator: torch.Generator,
) -> tuple[tuple, dict[str, Any]]:
    if source.inputs != "features":
        vocab = next(m for m in model.modules() if isinstance(m, nn.Embedding)).num_embeddings
        tokens = torch.randint(0, vocab, (batch, seq_len or 128), generator=generator)
        if source.inputs == "hf":
            return (), {"input_ids": tokens, "labels": tokens}
        return (tokens,), {}
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise UserError(
            f"{source.label}: neither an embedding nor a linear layer comes first, "
            f"so infinity-plan cannot make its input"
        )
    shape = (batch, seq_len, first.in_features) if seq_len else (batch, first.in_features)
    return (torch.randn(shape, generator=generator),), {}


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a step: the model's own (``.loss``, a scalar) or its output's mean square."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, dict):
        output = next(iter(output.values()))
    if not isinstance(output, torch.Tensor):
        raise UserError(
            f"the model returned a {type(output).__name__}: infinity-plan needs a "
            f"tensor (or .loss) to call backward on"
        )
    return output if output.dim() == 0 else output.float().square().mean()


def record(
    source: ModelSource, model: nn.Module, args: argparse.Namespace, swap_dir: Path
) -> tuple[Recording, dict[str, Any]]:
    """Trains ``model`` for ``args.steps`` steps here with its parameters and optimizer state
    on NVMe, and returns the store's recording (``planner.recording_of``)."""
    params = parameter_count(model)
    available = psutil.virtual_memory().available
    # Cached whole when it fits comfortably, so that the step's compute is measured without
    # swap threads competing for the cores; the compute times exclude the store's waits anyway.
    cache_all = 17 * params * 4 // 4 + (64 << 20)
    host_budget = max(16 << 20, min(cache_all, available // 4))
    buffer = min(16 << 20, max(MIN_BUFFER, host_budget // 16 // ALIGNMENT * ALIGNMENT))
    config = OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(swap_dir,),
        host_budget=host_budget,
        buffer_size=buffer,
        buffer_count=max(4, host_budget // buffer),
    )
    generator = torch.Generator().manual_seed(0)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters())
    seconds = []
    measured: list[list[float]] = []
    with TieredStore(config) as store:
        model, optimizer = store.attach(model, optimizer)
        for step in range(args.steps):
            call_args, kwargs = inputs_for(source, model, args.batch, args.seq_len, generator)
            started = time.perf_counter()
            loss = loss_of(model(*call_args, **kwargs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - started)
            if step:
                measured.append(list(planner.recording_of(store).trace.compute))
        recording = planner.recording_of(store)
        store.close(restore_params=False)
    # Each event's fastest followed step: on a shared machine a slow step is someone else's
    # load, not the model's compute.
    trace = recording.trace
    trace.compute = (
        [min(times) for times in zip(*measured)]
        if all(len(m) == len(trace.events) for m in measured)
        else trace.compute
    )
    return recording, {
        "parameters": params,
        "step_seconds": min(seconds[1:]),
        "compute_seconds": sum(recording.trace.compute),
    }


def measure_contention(
    source: ModelSource, model: nn.Module, args: argparse.Namespace, swap_dir: Path
) -> Contention:
    """How ``model``'s plain training step (in memory, no store) and the swap engine, streaming
    reads and writes on ``swap_dir`` with the store's engine settings, slow each other here."""
    generator = torch.Generator().manual_seed(0)
    optimizer = OPTIMIZERS[args.optimizer](model.parameters())

    def step() -> None:
        call_args, kwargs = inputs_for(source, model, args.batch, args.seq_len, generator)
        loss_of(model(*call_args, **kwargs)).backward()
        optimizer.step()
        optimizer.zero_grad()

    config = OffloadConfig(offload_param="nvme", nvme_path=(swap_dir,))
    return contention.measure_for_planner(
        swap_dir, config, step, "the model's plain step", 256 << 20
    )


def measure_update_seconds(optimizer: str, numel: int = 1 << 23, repeats: int = 3) -> float:
    """Seconds per element of the optimizer's update on large fp32 tensors, with the kernel
    the store runs (torch's fused CPU Adam/AdamW, as ``fused_optimizer`` picks)."""
    cls = OPTIMIZERS[optimizer]
    params = [nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    kwargs = {"fused": True} if cls in (torch.optim.Adam, torch.optim.AdamW) else {}
    opt = cls(params, **kwargs)
    opt.step()
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - started)
    return best / numel
