"""Hugging Face ``Trainer`` on an attached model, in one process or across ranks (``torchrun``,
``accelerate launch``).

Two ways in, both on every rank::

    # 1. attach first (the two lines), then the trainer with the optimizer attach returned
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    trainer = InfinityTrainer(model=model, args=args, train_dataset=data,
                              optimizers=(optimizer, scheduler))

    # 2. the trainer attaches: Trainer builds its optimizer from TrainingArguments as usual,
    #    then attaches the model (a peft model included) with it to a store made from the config
    trainer = InfinityTrainer(model=model, args=args, train_dataset=data, offload_config=config)

Other Trainer subclasses (``Seq2SeqTrainer``, TRL's ``SFTTrainer``) get the same with
``with_store(SFTTrainer)``; ``InfinitySeq2SeqTrainer`` is that for ``Seq2SeqTrainer``.

What the mixin changes, through Trainer's overridable methods:

* the model is prepared by accelerate's evaluation mode (no ``DistributedDataParallel``, no device
  move: the store places the parameters and averages gradients across ranks), and the optimizer
  without accelerate's device placement (which would round-trip its whole state through host
  memory);
* checkpoints (``save_strategy``, ``resume_from_checkpoint``, ``load_best_model_at_end``) are the
  store's, saved and loaded by every rank into ``checkpoint-N/infinity`` (the LR scheduler's state
  in it): no ``optimizer.pt`` and no weights file, nothing gathered into one process, nothing
  pickled; Trainer's own ``trainer_state.json`` and RNG files stay beside it;
* ``save_model()`` writes ``from_pretrained``-loadable safetensors assembled one file at a time
  from a store checkpoint (a peft model: only its adapter, read parameter by parameter);
* Trainer settings that cannot work on top of the store are refused, naming what to use instead.

Gradient clipping (``max_grad_norm``), accumulation and the logged ``grad_norm`` are Trainer's own:
``clip_grad_norm_`` over the attached model's parameters returns the store's global norm before
clipping.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from infinity.config import OffloadConfig
from infinity.errors import AttachError, CheckpointError, ConfigError
from infinity.integrations.common import (
    CHECKPOINT_DIR,
    attached_store,
    check_optimizer,
    export_pretrained,
    trainable_state,
)
from infinity.store import TieredStore

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the [hf] extra
    raise ImportError(
        "infinity.integrations.hf needs transformers and accelerate: "
        "pip install 'infinity-offload[hf]'"
    ) from exc

log = logging.getLogger(__name__)

FRAMEWORK = "InfinityTrainer"

# What the mixin is mixed into, for the type checker.
if TYPE_CHECKING:
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class InfinityTrainerMixin(_TrainerBase):
    """Put before a ``transformers.Trainer`` class; see the module docstring."""

    def __init__(self, *args: Any, offload_config: OffloadConfig | None = None, **kwargs: Any):
        # The arguments as the Trainer class below this mixin names them (its subclasses, TRL's
        # SFTTrainer, have their own order).
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        given = bound.arguments
        model = given.get("model")
        _refuse_arguments(given.get("args"), given)
        store = attached_store(model, FRAMEWORK)
        if store is not None and offload_config is not None:
            raise AttachError(
                f"{FRAMEWORK}: the model is already attached to a TieredStore; pass either an "
                f"attached model or offload_config=..., not both"
            )
        if store is None and offload_config is None:
            raise AttachError(
                f"{FRAMEWORK}: the model is not attached to a TieredStore. Either attach it "
                f"first (model, optimizer = store.attach(model, optimizer)) and pass "
                f"optimizers=(optimizer, scheduler), or pass offload_config=OffloadConfig(...) "
                f"and the trainer attaches it with the optimizer it builds"
            )
        if store is not None:
            if given.get("peft_config") is not None:
                raise AttachError(
                    f"{FRAMEWORK}: peft_config would add adapter parameters to a model that is "
                    f"already attached; they would never train. Pass the plain model with "
                    f"offload_config=... (the trainer attaches it after peft wraps it), or apply "
                    f"peft.get_peft_model before store.attach"
                )
            optimizer, scheduler = given.get("optimizers") or (None, None)
            if optimizer is None and store.optimizer is not None:
                optimizer = store.optimizer  # the one attach wrapped: Trainer must not build one
            check_optimizer(store, optimizer, FRAMEWORK)
            given["optimizers"] = (optimizer, scheduler)
        self._infinity_store: TieredStore | None = store
        self._infinity_config = offload_config
        super().__init__(*bound.args, **bound.kwargs)

    @property
    def store(self) -> TieredStore | None:
        """The store the model is attached to (None until ``train()`` attaches it, when the
        trainer was given ``offload_config``)."""
        return self._infinity_store

    # -- the optimizer and the model ------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        store = self._infinity_store
        if store is not None:
            if self.optimizer is None:
                raise AttachError(
                    f"{FRAMEWORK}: the model was attached without an optimizer, so it cannot "
                    f"train: pass the optimizer to store.attach(model, optimizer)"
                )
            return self.optimizer
        optimizer = super().create_optimizer(model)
        store = TieredStore(self._infinity_config)
        _, wrapped = store.attach(_model_of(self), optimizer)
        assert wrapped is not None
        self._infinity_store, self.optimizer = store, wrapped
        log.info("%s: attached the model with Trainer's %s", FRAMEWORK, type(optimizer).__name__)
        return wrapped

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        if self._infinity_store is None:
            return super()._wrap_model(model, training, dataloader)
        accelerator = self.accelerator
        if accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model
        # accelerate's evaluation mode: no DistributedDataParallel, no move; it marks the model
        # prepared, so Trainer's accelerator.prepare(model, optimizer) leaves it as it is.
        model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        if training and self.optimizer is not None:
            # Without device placement, which would copy the whole optimizer state through host
            # memory; prepared, Trainer's own prepare() returns it untouched.
            self.optimizer = accelerator.prepare(self.optimizer, device_placement=[False])
        return model

    # -- checkpoints ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        store = self._infinity_store
        if store is None:
            return super().save_model(output_dir, _internal_call)
        out = Path(output_dir if output_dir is not None else str(self.args.output_dir))
        if _internal_call:  # a checkpoint: the training state, every rank its share
            store.save_checkpoint(out / CHECKPOINT_DIR, extra=self._checkpoint_extra())
            if self.args.should_save:
                self._save_processing_class(out)
            return
        model = _model_of(self)
        if _is_peft_model(model):
            state = trainable_state(model)  # every rank: each read is a collective
            if self.args.should_save:
                model.save_pretrained(str(out), state_dict=state)
        else:
            export_pretrained(store, out)
        if self.args.should_save:
            self._save_processing_class(out)
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_processing_class(self, out: Path) -> None:
        processing = self.processing_class
        if processing is not None and hasattr(processing, "save_pretrained"):
            processing.save_pretrained(str(out))

    def _checkpoint_extra(self) -> dict[str, Any]:
        scheduler = self.lr_scheduler
        return {"scheduler": scheduler.state_dict() if scheduler is not None else None}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._infinity_store is None:
            super()._save_optimizer_and_scheduler(output_dir)
        # else: both are in the store's checkpoint, which save_model wrote

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Runs before the optimizer (and, with offload_config, the store) exist: check only;
        # _load_optimizer_and_scheduler loads the state once everything is in place.
        checkpoint = Path(resume_from_checkpoint) / CHECKPOINT_DIR
        if not checkpoint.is_dir():
            raise CheckpointError(
                f"{resume_from_checkpoint} has no store checkpoint ({checkpoint} is missing): "
                f"resume from a checkpoint-N directory an {FRAMEWORK} run saved (a save cut "
                f"short leaves the previous checkpoint, not this one)"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        store = self._infinity_store
        if store is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        extra = store.load_checkpoint(Path(checkpoint) / CHECKPOINT_DIR) or {}
        scheduler_state = extra.get("scheduler")
        if scheduler_state is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(scheduler_state)

    def _load_best_model(self) -> None:
        store = self._infinity_store
        if store is None:
            return super()._load_best_model()
        best = Path(str(self.state.best_model_checkpoint)) / CHECKPOINT_DIR
        log.info("%s: loading the best model from %s", FRAMEWORK, best)
        store.load_checkpoint(best)

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"{FRAMEWORK}: hyperparameter_search builds a model per trial (model_init), which "
            f"the store cannot attach behind Trainer's back: run one trial per process, each "
            f"attaching its own model"
        )

    # -- evaluation with generate ---------------------------------------------------------------
    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> Any:
        if getattr(self.args, "predict_with_generate", False) and not prediction_loss_only:
            # Ranks whose sequences end at different lengths must still run the same forwards:
            # each one gathers the parameters from every rank.
            if not gen_kwargs and hasattr(self, "_gen_kwargs"):
                gen_kwargs = self._gen_kwargs.copy()
            gen_kwargs.setdefault(
                "synced_gpus", dist.is_initialized() and dist.get_world_size() > 1
            )
            return super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs
            )
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


def _refuse_arguments(args: Any, given: dict[str, Any]) -> None:
    """Trainer settings that cannot work on top of the store, refused before Trainer acts on
    them, each naming what to use instead."""
    if given.get("model_init") is not None:
        raise ConfigError(
            f"{FRAMEWORK}: model_init builds a new model for each train() call, which the store "
            f"cannot attach: build the model once and pass model=..."
        )
    if args is None:
        return
    precision = [
        name
        for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval")
        if getattr(args, name, False)
    ]
    if precision:
        # Named as the user wrote them: TRL's SFTConfig turns bf16 on by default, so the
        # way out must be spelled on that class, not on TrainingArguments.
        settings = ", ".join(f"{n}=True" for n in precision)
        off = ", ".join(f"{n}=False" for n in precision)
        raise ConfigError(
            f"{FRAMEWORK}: {type(args).__name__}({settings}) would add accelerate's autocast "
            f"and loss scaling on top of the store's own precision: pass {off} to "
            f"{type(args).__name__} and set OffloadConfig.precision instead (e.g. "
            f"precision=infinity.PrecisionConfig(dtype='bf16'))"
        )
    if getattr(args, "deepspeed", None):
        raise ConfigError(
            f"{FRAMEWORK}: TrainingArguments(deepspeed=...) would hand the model to DeepSpeed, "
            f"and the store already does what its ZeRO does: drop deepspeed= and build the "
            f"store's config from the same file with OffloadConfig.from_deepspeed(path)"
        )
    if getattr(args, "fsdp", None):
        raise ConfigError(
            f"{FRAMEWORK}: TrainingArguments(fsdp=...) would shard the model a second time: "
            f"drop fsdp= (the store partitions the training state across ranks; "
            f"OffloadConfig.zero_stage)"
        )
    if getattr(args, "torch_compile", False):
        raise ConfigError(
            f"{FRAMEWORK}: TrainingArguments(torch_compile=True) compiles the whole model "
            f"around the store's hooks, which is not supported: compile the model's blocks "
            f"before attach instead (see the README's torch.compile section)"
        )
    if getattr(getattr(args, "parallel_mode", None), "value", "") == "not_distributed":
        raise ConfigError(
            f"{FRAMEWORK}: {args.n_gpu} GPUs in one process would replicate the model with "
            f"nn.DataParallel: launch one process per GPU instead (torchrun --nproc-per-node "
            f"{args.n_gpu} train.py)"
        )


def _model_of(trainer: Any) -> Any:
    """The model the trainer was given (set by Trainer's __init__)."""
    model = trainer.model
    if model is None:
        raise ConfigError(f"{FRAMEWORK}: no model: pass model=...")
    return model


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def with_store(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, such as TRL's ``SFTTrainer``)
    with the store's glue: ``with_store(SFTTrainer)(model=..., args=..., offload_config=...)``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"with_store expects a transformers.Trainer subclass, got {trainer_class}")
    if issubclass(trainer_class, InfinityTrainerMixin):
        return trainer_class
    return type(
        f"Infinity{trainer_class.__name__}",
        (InfinityTrainerMixin, trainer_class),
        {"__module__": __name__, "__doc__": f"{trainer_class.__name__} on an attached model."},
    )


class InfinityTrainer(InfinityTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` on an attached model; see the module docstring."""


class InfinitySeq2SeqTrainer(InfinityTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` on an attached model; generation across ranks runs with
    ``synced_gpus=True`` (every rank runs the same forwards)."""
