"""Mixed precision: working-copy dtype and the fp16 dynamic loss scaler.

Masters stay fp32 wherever they live; a gathered device copy is cast to the compute dtype, and
after a step the next gather casts the updated master again, so the working copy is always
refreshed from its master.

Loss scaling without touching the user's loop: a hook on the root module's outputs multiplies
the gradient flowing back into them by the scale, which is what ``(loss * scale).backward()``
does to every parameter gradient. Gradients are unscaled as they leave the device; the step
checks the global gradient norm, and on inf/nan skips the update and lowers the scale
(DeepSpeed's rules: ``hysteresis`` overflows before halving, doubling after ``loss_scale_window``
clean steps, never below ``min_loss_scale``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from infinity.config import PrecisionConfig

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: precision.storage_dtype -> the dtype offloaded parameters are kept in (None: the masters');
#: int8 and int4 store weights quantized (infinity.inference.quantized) and are not here
STORAGE_DTYPES = {
    "auto": None,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: precision.master_dtype -> the dtype of the masters under mixed precision
MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def stored_dtype(config: PrecisionConfig) -> torch.dtype | None:
    """``precision.storage_dtype`` as a dtype, or None where the masters are kept as they are
    (``auto``; or bf16 masters, which are already what gathers read: no copy beside them)."""
    if config.widened_masters:
        return None
    return STORAGE_DTYPES.get(config.storage_dtype)


class LossScaler:
    def __init__(self, config: PrecisionConfig) -> None:
        self.dynamic = config.loss_scale == 0
        self.scale = (
            float(2**config.initial_scale_power) if self.dynamic else float(config.loss_scale)
        )
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self._tolerance = config.hysteresis
        self._clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Called once per step with whether the gradients overflowed."""
        if overflow:
            self.skipped_steps += 1
            self._clean_steps = 0
            if not self.dynamic:
                log.warning("gradient overflow with static loss scale %g: step skipped", self.scale)
                return
            self._tolerance -= 1
            if self._tolerance <= 0:
                old = self.scale
                self.scale = max(self.scale / 2, self.min_scale)
                self._tolerance = self.hysteresis
                log.info("gradient overflow: step skipped, loss scale %g -> %g", old, self.scale)
            else:
                log.info("gradient overflow: step skipped, loss scale stays %g", self.scale)
            return
        self._clean_steps += 1
        if self.dynamic and self._clean_steps >= self.window:
            self.scale *= 2
            self._clean_steps = 0
            self._tolerance = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps to resume the same scaling."""
        return {
            "scale": self.scale,
            "tolerance": self._tolerance,
            "clean_steps": self._clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._tolerance = int(state["tolerance"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def install(self, root: nn.Module) -> Any:
        """Scales the gradient entering the root module's outputs during backward."""

        def scale_outputs(module: nn.Module, args: Any, output: Any) -> None:
            if module is not root or not torch.is_grad_enabled():
                return  # (a deep copy of the model carries this hook too)
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: grad * self.scale)

        return root.register_forward_hook(scale_outputs)


def global_norm(sq_norms: list[float]) -> float:
    total = math.fsum(sq_norms)
    return math.sqrt(total) if math.isfinite(total) else float("inf")
