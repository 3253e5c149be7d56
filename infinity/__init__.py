"""infinity: an NVMe/CPU offload runtime for PyTorch training.

The public API is this module's names::

    config = infinity.OffloadConfig(...)             # or OffloadConfig.from_deepspeed(...)
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, optimizer)
    ...the training loop, unchanged (p.grad, clip_grad_norm_ included)...
    with store.gathered(params, modify=True): ...   # edit parameters outside forward
    store.stats(); store.close()
"""

from infinity.config import AioConfig, BatchConfig, OffloadConfig, PrecisionConfig
from infinity.core.residency import Residency, ResidencyError
from infinity.core.store import TieredStore
from infinity.errors import (
    AttachError,
    BudgetError,
    CheckpointError,
    ConfigError,
    InfinityError,
    ParameterAccessError,
    RankError,
)

__all__ = [
    "AioConfig",
    "AttachError",
    "BatchConfig",
    "BudgetError",
    "CheckpointError",
    "ConfigError",
    "InfinityError",
    "OffloadConfig",
    "ParameterAccessError",
    "PrecisionConfig",
    "RankError",
    "Residency",
    "ResidencyError",
    "TieredStore",
]
