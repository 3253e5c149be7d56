"""PyTorch Lightning on an attached model: a strategy.

::

    trainer = pl.Trainer(strategy=InfinityStrategy(OffloadConfig(...)), devices=N,
                         gradient_clip_val=1.0, callbacks=[ModelCheckpoint(...)])
    trainer.fit(module, data)                        # ckpt_path=... resumes

The module is written as usual (``configure_optimizers`` returns one optimizer, with or without
LR schedulers). The strategy is Lightning's DDP strategy for processes (launching with
``devices=N`` or under ``torchrun``, the process group, the distributed sampler, collectives for
``self.log(..., sync_dist=True)``), but instead of wrapping the module in
``DistributedDataParallel`` it attaches it to a :class:`~infinity.TieredStore` on every rank once
``configure_optimizers`` has built the optimizer. The module stays attached after ``fit`` (never
gathered whole into memory: ``validate``/``test``/``predict`` and ``trainer.save_checkpoint``
use it as it is; a later ``fit`` attaches it again with a new optimizer); ``strategy.close()``
gives the module its values back as ordinary tensors, and the process's exit closes the store
otherwise.

Clipping (``gradient_clip_val``, by norm or value) runs over the module's parameters, whose
gradients are the store's: the norm is the global one across ranks. Checkpoints are
directories: every rank saves its share of the training state with ``store.save_checkpoint``
(masters and optimizer state, never gathered, never pickled), and the first rank adds Lightning's
own state (loops, callbacks, LR schedulers, hyperparameters) as ``lightning.pt`` through the
trainer's checkpoint I/O, as Lightning's FSDP and DeepSpeed strategies do. ``ckpt_path=`` loads
both, on any number of ranks.

Mixed precision is the store's (``OffloadConfig.precision``): the trainer's ``precision`` must stay
``"32-true"``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from infinity.config import OffloadConfig
from infinity.errors import AttachError, CheckpointError, ConfigError
from infinity.store import TieredStore

try:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.strategies import DDPStrategy
    from pytorch_lightning.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - the [lightning] extra
    raise ImportError(
        "infinity.integrations.lightning needs pytorch-lightning: "
        "pip install 'infinity-offload[lightning]'"
    ) from exc

log = logging.getLogger(__name__)

STRATEGY = "InfinityStrategy"
#: Lightning's own state (loops, callbacks, schedulers) inside a checkpoint directory
LIGHTNING_STATE = "lightning.pt"


class InfinityPrecision(Precision):
    """Lightning's fp32 precision, clipping over the module's parameters (``p.grad`` is the
    store's gradient) rather than the optimizer's, which are the store's per-shard copies."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self._module = module

    def main_params(self, optimizer: Any) -> Any:
        return [p for p in self._module.parameters() if p.requires_grad]


class InfinityStrategy(DDPStrategy):
    """See the module docstring. ``config``: the store's :class:`~infinity.OffloadConfig` (or a
    dict of its fields); its ``device='auto'`` becomes this rank's device."""

    strategy_name = "infinity"

    def __init__(
        self,
        config: OffloadConfig | dict[str, Any] | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        if isinstance(config, dict):
            config = OffloadConfig.from_dict(config)
        self.config = config or OffloadConfig()
        #: the store the module is attached to (None before the first stage and after close())
        self.store: TieredStore | None = None

    # -- set-up ------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self.num_nodes * self.num_processes > 1 or dist.is_initialized():
            super().setup_environment()  # the process group, as Lightning's DDP makes it
            return
        # One process: nothing to communicate with, so no process group is made for it (the
        # collectives below run only where one exists).
        self.set_world_ranks()
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        precision = self.precision_plugin
        if type(precision) is not Precision and not isinstance(precision, InfinityPrecision):
            raise ConfigError(
                f"{STRATEGY}: Trainer(precision={getattr(precision, 'precision', '?')!r}) would "
                f"add Lightning's precision handling on top of the store's: leave precision at "
                f"'32-true' and set OffloadConfig.precision instead (e.g. "
                f"precision=infinity.PrecisionConfig(dtype='bf16'))"
            )
        if self._layer_sync is not None:
            raise ConfigError(
                f"{STRATEGY}: sync_batchnorm=True is not supported on an attached model"
            )
        self.precision_plugin = InfinityPrecision(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.close()  # a new fit: a new optimizer, attached with the module again
            self.model_to_device()
            self.setup_optimizers(trainer)  # configure_optimizers as written, then attach
        elif self.store is None or self.store.model is not self.lightning_module:
            self.close()
            self.model_to_device()
            self._attach(None)
        self.setup_precision_plugin()
        # No DistributedDataParallel, no broadcast of the module's states (the store starts
        # every rank from rank 0's values) and no move of optimizer state to the device.

    def model_to_device(self) -> None:
        # Parameters are the store's to place; buffers go to this rank's device.
        assert self.model is not None
        device = self.root_device
        for name, buffer in list(self.model.named_buffers()):
            if buffer.device != device:
                owner, _, leaf = name.rpartition(".")
                setattr(self.model.get_submodule(owner), leaf, buffer.to(device))

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ConfigError(
                f"{STRATEGY}: configure_optimizers returned {len(self.optimizers)} optimizers; "
                f"the store steps one optimizer over the whole model: return one (with several "
                f"param groups if need be)"
            )
        (original,) = self.optimizers
        wrapped = self._attach(original)
        self.optimizers = [wrapped]
        rebound = False
        for config in self.lr_scheduler_configs:
            # Schedulers were built over the optimizer configure_optimizers made; they must
            # now move the learning rates of the one the store steps.
            if getattr(config.scheduler, "optimizer", None) is original:
                config.scheduler.optimizer = wrapped
                rebound = True
        if rebound:
            _track_steps_for_schedulers(wrapped)

    def _attach(self, optimizer: torch.optim.Optimizer | None) -> Any:
        config = self.config
        if config.device == "auto":
            config = config.replace(device=str(self.root_device))
        module = self.lightning_module
        assert module is not None
        self.store = TieredStore(config)
        _, wrapped = self.store.attach(module, optimizer)
        return wrapped

    # -- backward: nothing of DistributedDataParallel's to prepare ----------------------------
    def pre_backward(self, closure_loss: Tensor) -> None:
        pass

    def post_backward(self, closure_loss: Tensor) -> None:
        pass

    # -- checkpoints: the store's, every rank its share ----------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module must be attached before its state is loaded

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the store's checkpoint holds the optimizer's state

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # never gathered: the store's checkpoint holds the parameters

    def optimizer_state(self, optimizer: Any) -> dict[str, Tensor]:
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded with the store's checkpoint in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise ConfigError(f"{STRATEGY}: storage_options are not supported")
        store = self._store_for("saving a checkpoint")
        path = Path(self.broadcast(str(filepath)))
        checkpoint = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        store.save_checkpoint(path)  # every rank; atomic: <path>.partial until complete
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, path / LIGHTNING_STATE)
        self.barrier("InfinityStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        store = self._store_for("loading a checkpoint")
        path = Path(checkpoint_path)
        state = path / LIGHTNING_STATE
        if not state.is_file():
            raise CheckpointError(
                f"{path} is not a checkpoint of {STRATEGY} ({state} is missing): resume from a "
                f"checkpoint directory it saved"
            )
        store.load_checkpoint(path)
        return self.checkpoint_io.load_checkpoint(state, weights_only=weights_only)

    def _store_for(self, what: str) -> TieredStore:
        if self.store is None:
            raise AttachError(f"{STRATEGY}: {what} needs the module attached (inside fit)")
        return self.store

    # -- teardown -------------------------------------------------------------------------------
    def teardown(self) -> None:
        # What Lightning's teardown does, but the module stays attached: moving it to the CPU
        # (and the optimizer's state) would take every parameter into memory, or be refused on
        # a GPU store. The store is closed by close(), a later fit, or the process's exit.
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def close(self, restore_params: bool = True) -> None:
        """Closes the store: with ``restore_params`` the module's parameters get their values
        back as ordinary tensors (every parameter in memory at once), on every rank together."""
        if self.store is not None:
            store, self.store = self.store, None
            store.close(restore_params)


def _track_steps_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """PyTorch's LR schedulers check that ``optimizer.step()`` ran before their first step
    through a marker they put on the optimizer's ``step`` when they are built; schedulers moved
    onto the wrapped optimizer would warn that its step "has been overridden". Building a
    constant scheduler over it puts the marker there; the learning rates it resets are put back."""
    rates = [group["lr"] for group in optimizer.param_groups]
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
