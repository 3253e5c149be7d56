"""A clear error instead of a crash when an attached model is wrapped in DistributedDataParallel.

DDP broadcasts every parameter from rank 0 in C++ at construction, reading their storages
directly: an attached parameter's storage is empty between uses (its values live in the store's
tiers), so that read crashes the process (SIGSEGV) before any Python code could object. And DDP
is not needed: the store already starts every rank from rank 0's values and averages the
gradients across ranks; a DDP wrapper would reduce them a second time.

Before it broadcasts, DDP (and Lightning's DDP strategy) reads the module's
``_ddp_params_and_buffers_to_ignore`` as an iterable of names, the documented way to exclude
parameters (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``). Every
module of an attached model gets an object there whose iteration raises
:class:`~infinity.errors.AttachError` naming what to do instead. Copies of the model
(``copy.deepcopy``, pickling) are plain models and get an empty list: nothing ignored.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from torch import nn

from infinity.errors import AttachError

ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


#: (module prefix of a framework that wraps models in DDP, what it is, the integration that
#: runs it on an attached model instead), outermost first: a Trainer calls accelerate's prepare()
_WRAPPERS = (
    (
        ("transformers.",),
        "Hugging Face Trainer",
        "infinity.integrations.hf.InfinityTrainer (transformers.Trainer's arguments, with the "
        "attached model and optimizers=(optimizer, scheduler), or the plain model and "
        "offload_config=...)",
    ),
    (
        ("lightning.", "pytorch_lightning."),
        "Lightning's 'ddp' strategy",
        "infinity.integrations.lightning.InfinityStrategy (Trainer(strategy=InfinityStrategy("
        "offload_config)) on the plain LightningModule; it attaches the model)",
    ),
    (
        ("accelerate.",),
        "accelerate's prepare()",
        "infinity.integrations.accelerate.InfinityAccelerator (an Accelerator whose prepare() "
        "leaves the attached model as it is)",
    ),
)


def wrapping_framework(frame: FrameType | None) -> tuple[str, str] | None:
    """The framework whose code is on the stack from ``frame`` outwards (the outermost one of
    :data:`_WRAPPERS`), as (what it is, the integration to use instead); None: DDP was called
    directly."""
    found = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        for prefixes, what, integration in _WRAPPERS:
            if module.startswith(prefixes):
                found = (what, integration)  # keep going: the outermost caller decides
                break
        frame = frame.f_back
    return found


class _RefuseDDP:
    """Stands as ``_ddp_params_and_buffers_to_ignore`` of an attached model's modules."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def __iter__(self) -> Any:
        reason = (
            f"{self.model_name} is attached to a TieredStore, which already starts every rank "
            f"from the same values and averages gradients across ranks, so it must not be "
            f"wrapped in DistributedDataParallel"
        )
        framework = wrapping_framework(sys._getframe(1))
        if framework is not None:
            what, integration = framework
            raise AttachError(f"{reason}, and {what} wraps it: use {integration} instead")
        raise AttachError(
            f"{reason}: use the model attach() returned as it is (no DDP). Frameworks that wrap "
            f"models in DDP have integrations that do not: Hugging Face Trainer -> "
            f"infinity.integrations.hf.InfinityTrainer, accelerate's prepare() -> "
            f"infinity.integrations.accelerate.InfinityAccelerator, Lightning's 'ddp' strategy "
            f"-> infinity.integrations.lightning.InfinityStrategy"
        )

    def __deepcopy__(self, memo: dict) -> list[str]:
        return []  # a copy is a plain model

    def __reduce__(self) -> Any:
        return (list, ())


class DDPGuard:
    """Installs the guard on every module of ``model``; :meth:`remove` puts back what was there."""

    def __init__(self, model: nn.Module) -> None:
        guard = _RefuseDDP(type(model).__name__)
        self._previous: list[tuple[nn.Module, Any]] = []
        for module in model.modules():
            self._previous.append((module, module.__dict__.get(ATTRIBUTE, _MISSING)))
            setattr(module, ATTRIBUTE, guard)

    def remove(self) -> None:
        for module, previous in self._previous:
            if previous is _MISSING:
                module.__dict__.pop(ATTRIBUTE, None)
            else:
                setattr(module, ATTRIBUTE, previous)
        self._previous = []


_MISSING = object()
