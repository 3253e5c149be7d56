"""What a store runs on: its device, the tiers it makes under its budgets, the swap engine it
opens, and what the machine itself keeps updates out of backward for.

The store asks its :class:`Machine` for each of these (``TieredStore(config, machine=...)``),
and this machine is the real one. The planner replays the store's own attach, placement and
step code on a simulated machine (tensors on the meta device, a clock instead of the disk:
:mod:`infinity.planning.planner`) by passing one of its own: a public seam the store composes,
instead of a subclass of the store overriding its private methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infinity.core.budgets import MemoryPlan
from infinity.core.streams import device_named
from infinity.core.tiers import DeviceTier, HostTier
from swap import SwapEngine


def resolve_device(name: str) -> torch.device:
    """The device ``name`` names, with its index (``cuda`` is ``cuda:N``, N the current device):
    tensors made on it report one, and every comparison with them must see the same device."""
    return device_named(name, torch.cuda.is_available(), torch.cuda.current_device)


class Machine:
    """This machine: the device the config names, tiers holding real bytes, the swap engine
    the store opens (see the module docstring)."""

    def device(self, name: str) -> torch.device:
        """The device the config's ``device`` names."""
        return resolve_device(name)

    def device_kind(self, device: torch.device) -> str:
        """What the device's budget is derived from: "cpu" (host memory), "cuda" (its own
        memory) or "other" (every parameter fits)."""
        return device.type if device.type in ("cpu", "cuda") else "other"

    def tiers(
        self, plan: MemoryPlan, device: torch.device, copies: int, pin_memory: bool
    ) -> tuple[DeviceTier, HostTier]:
        """The device and host tiers under ``plan``'s budgets (``copies``: the parameters'
        device copies the device tier's slab holds)."""
        return (
            DeviceTier(device, plan.device, copies=copies),
            HostTier(plan.host_tier, plan.arena, pin_memory, slot_size=plan.slot),
        )

    def engine(self, open_engine: Callable[[], SwapEngine]) -> SwapEngine:
        """The swap engine: the one ``open_engine`` opens under the store's ``nvme_path``."""
        return open_engine()

    def update_reasons(self) -> list[str]:
        """What keeps updates out of backward here beyond the config's own reasons: nothing on
        a real machine (the loop's own are found by watching it)."""
        return []
