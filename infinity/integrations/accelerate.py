"""``accelerate`` loops on an attached model, in one process or under ``accelerate launch``.

The one line a script changes is the accelerator's class::

    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    accelerator = InfinityAccelerator()          # was: accelerate.Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ...accelerator.backward(loss); accelerator.clip_grad_norm_(model.parameters(), 1.0)...
    accelerator.save_state("ckpt"); accelerator.load_state("ckpt")

``prepare`` gives an attached model accelerate's evaluation-mode preparation (no
``DistributedDataParallel``, no device move: the store places the parameters and averages
gradients across ranks) and the attached optimizer no device placement (which would copy its
whole state through host memory); other models and optimizers are prepared as accelerate does.
``save_state`` / ``load_state`` keep accelerate's handling of schedulers, samplers, RNG states and
registered objects, and put the attached models and optimizers in the store's checkpoint
(``<dir>/infinity``), saved and loaded by every rank: nothing gathered, nothing pickled.
``save_model`` writes safetensors assembled one file at a time from a store checkpoint.
``backward``, ``clip_grad_norm_`` (the global norm before clipping), ``accumulate``, ``gather``
and the rest are accelerate's own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from infinity.errors import AttachError, ConfigError
from infinity.integrations.common import (
    CHECKPOINT_DIR,
    attached_store,
    check_optimizer,
    export_pretrained,
)
from infinity.store import TieredStore
from infinity.training.optimizer import OffloadedOptimizer

try:
    import accelerate
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - the [hf] extra
    raise ImportError(
        "infinity.integrations.accelerate needs accelerate: pip install 'infinity-offload[hf]'"
    ) from exc

log = logging.getLogger(__name__)

FRAMEWORK = "InfinityAccelerator"
_REFUSED_TYPES = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
}


class InfinityAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that knows attached models; see the module docstring."""

    # accelerate's lists of prepared models and optimizers (set in its __init__)
    _models: list[Any]
    _optimizers: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mixed_precision != "no":
            raise ConfigError(
                f"{FRAMEWORK}: mixed_precision={self.mixed_precision!r} would add accelerate's "
                f"autocast and loss scaling on top of the store's own precision: leave it 'no' "
                f"(also in the accelerate config) and set OffloadConfig.precision instead"
            )
        engine = _REFUSED_TYPES.get(self.distributed_type)
        if engine is not None:
            raise ConfigError(
                f"{FRAMEWORK}: the accelerate config asks for {engine}, which would take the "
                f"model over from the store: use a plain multi-process config (accelerate launch "
                f"--multi_gpu, or --num_processes N with CPUs), the store partitions the state"
            )
        if getattr(self, "parallelism_config", None) is not None:
            raise ConfigError(
                f"{FRAMEWORK}: parallelism_config (tensor, context or sequence parallelism) is "
                f"not supported on an attached model: leave it unset"
            )

    # -- prepare ----------------------------------------------------------------------------------
    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if attached_store(model, FRAMEWORK) is None:
            return super().prepare_model(model, device_placement, evaluation_mode)
        # No DistributedDataParallel and no move; marked prepared like any other model.
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: Any, device_placement: bool | None = None) -> Any:
        store = _store_of_optimizer(optimizer)
        if store is not None:
            check_optimizer(store, optimizer, FRAMEWORK)
            device_placement = False
        elif _steps_attached_parameters(optimizer):
            raise AttachError(
                f"{FRAMEWORK}: this optimizer holds parameters of an attached model but is not "
                f"the optimizer store.attach returned: build it before attach, pass it to "
                f"store.attach(model, optimizer) and prepare the one attach returns"
            )
        return super().prepare_optimizer(optimizer, device_placement)

    # -- checkpoints ------------------------------------------------------------------------------
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Any:
        stores = self._stores()
        if not stores:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        with self._without_attached(stores):
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        (store,) = stores
        store.save_checkpoint(Path(location) / CHECKPOINT_DIR)
        return location

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        stores = self._stores()
        if not stores:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        (store,) = stores
        # accelerate resolves the directory (automatic checkpoint naming) and hands it to the
        # load hooks first: the store's state is loaded there, on every rank.
        handle = self.register_load_state_pre_hook(
            lambda models, directory: store.load_checkpoint(Path(directory) / CHECKPOINT_DIR)
        )
        try:
            with self._without_attached(stores):
                super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            handle.remove()

    def save_model(self, model: nn.Module, save_directory: str, **kwargs: Any) -> None:
        store = attached_store(self.unwrap_model(model), FRAMEWORK)
        if store is None:
            return super().save_model(model, save_directory, **kwargs)
        export_pretrained(store, save_directory)

    # -- the attached models among the prepared objects ------------------------------------------
    def _stores(self) -> list[TieredStore]:
        stores: list[TieredStore] = []
        for model in self._models:
            store = attached_store(self.unwrap_model(model), FRAMEWORK)
            if store is not None and store not in stores:
                stores.append(store)
        if len(stores) > 1:
            raise ConfigError(
                f"{FRAMEWORK}: save_state/load_state with {len(stores)} attached models: one "
                f"attached model per accelerator (each store checkpoints on its own: "
                f"store.save_checkpoint(path))"
            )
        return stores

    @contextlib.contextmanager
    def _without_attached(self, stores: list[TieredStore]) -> Iterator[None]:
        """accelerate's save and load without the attached models and their optimizers, whose
        state is the store's checkpoint: a state_dict() would gather the model into every
        process, and the optimizer's would be pickled whole."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if store_of_model(self, m) not in stores]
        self._optimizers = [o for o in optimizers if _store_of_optimizer(o) not in stores]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers


def store_of_model(accelerator: accelerate.Accelerator, model: nn.Module) -> TieredStore | None:
    return attached_store(accelerator.unwrap_model(model), FRAMEWORK)


def _store_of_optimizer(optimizer: Any) -> TieredStore | None:
    """The store of an attached optimizer (or of accelerate's wrapper around one)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, OffloadedOptimizer) and isinstance(inner.store, TieredStore):
        return inner.store
    return None


def _steps_attached_parameters(optimizer: Any) -> bool:
    from infinity.core.lifecycle import open_stores

    stores = open_stores()
    if not stores:
        return False
    for group in getattr(optimizer, "param_groups", []):
        for param in group["params"]:
            if any(s.registry.entry_of(param) is not None for s in stores):
                return True
    return False
