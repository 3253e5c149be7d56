"""infinity: an NVMe/CPU offload runtime for PyTorch training.

The public API is this module's names::

    config = infinity.OffloadConfig(...)             # or OffloadConfig.from_deepspeed(...)
    store = infinity.TieredStore(config)
    model, optimizer = store.attach(model, optimizer)
    ...the training loop, unchanged (p.grad, clip_grad_norm_ included)...
    with store.gathered(params, modify=True): ...   # edit parameters outside forward
    store.stats(); store.close()
    infinity.store_of(model)                         # the store a model is attached to
    cache = store.kv_cache(target="nvme")            # generate(..., cache=cache): KV offloaded

The trainers people launch have their glue in ``infinity.integrations`` (each imports its
framework only when used): ``infinity.hf.InfinityTrainer`` (Hugging Face Trainer),
``infinity.accelerate.InfinityAccelerator`` and ``infinity.lightning.InfinityStrategy``.
"""

import importlib
from typing import Any

from infinity.config import (
    AioConfig,
    BatchConfig,
    OffloadConfig,
    PrecisionConfig,
    read_deepspeed_with,
)
from infinity.core.lifecycle import store_of
from infinity.core.residency import Residency, ResidencyError
from infinity.deepspeed_config import DEEPSPEED
from infinity.errors import (
    AttachError,
    BudgetError,
    CheckpointError,
    ConfigError,
    InfinityError,
    ParameterAccessError,
    RankError,
)
from infinity.inference import KVOffloadConfig, offloaded_kv_cache
from infinity.store import TieredStore

# The DeepSpeed reader builds through infinity.config, which therefore cannot import it.
read_deepspeed_with(DEEPSPEED)

__all__ = [
    "AioConfig",
    "AttachError",
    "BatchConfig",
    "BudgetError",
    "CheckpointError",
    "ConfigError",
    "InfinityError",
    "KVOffloadConfig",
    "OffloadConfig",
    "ParameterAccessError",
    "PrecisionConfig",
    "RankError",
    "Residency",
    "ResidencyError",
    "TieredStore",
    "offloaded_kv_cache",
    "store_of",
]

#: integrations reachable as attributes (``infinity.lightning``), imported on first use
_INTEGRATIONS = ("hf", "accelerate", "lightning")


def __getattr__(name: str) -> Any:
    if name in _INTEGRATIONS:
        module = importlib.import_module(f"infinity.integrations.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'infinity' has no attribute {name!r}")
