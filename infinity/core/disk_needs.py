"""What the swap files hold: the bytes a run stores on NVMe, by kind, before it starts (the
preflight the store checks the free space against) and while it runs (the extents its shards
hold), so that the two can be set side by side in ``stats()['disk']``.

A run stores, for each shard of a parameter:

* its master, where masters live on NVMe; a frozen parameter's (one the optimizer does not
  update: ``requires_grad=False``, or in no param group) once, in its storage dtype
  (``precision.storage_dtype`` when set), and never written again;
* its compute copy (``precision.storage_dtype`` with an optimizer), for trained parameters only:
  a frozen one's master is already in that dtype;
* its gradient, where the optimizer's state is on NVMe and updates run in ``optimizer.step()``,
  in the master's dtype (see :func:`plan_disk`);
* its optimizer state, one companion per per-element state tensor, in
  ``precision.optimizer_state_dtype`` (fp32 state only: state in another dtype is kept as it is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from infinity.core.residency import Residency
from infinity.core.shards import GRAD_KEY, ParamEntry, Shard, ShardKind, ShardRegistry
from infinity.core.state_sizes import stored_nbytes

#: the kinds of bytes on NVMe, as ``stats()['disk']`` names them
KINDS = ("masters", "frozen", "compute", "grads", "state")


@dataclasses.dataclass(frozen=True)
class DiskBytes:
    """Bytes of the swap files by kind (each extent as the swap space lays it out)."""

    #: masters of trained parameters
    masters: int = 0
    #: frozen parameters' values (stored once, never written again)
    frozen: int = 0
    #: compute copies beside trained masters
    compute: int = 0
    #: gradients waiting for ``optimizer.step()``
    grads: int = 0
    #: optimizer state
    state: int = 0

    @property
    def total(self) -> int:
        return self.masters + self.frozen + self.compute + self.grads + self.state

    def as_dict(self) -> dict[str, int]:
        return {**{k: getattr(self, k) for k in KINDS}, "total": self.total}


def state_tensors(optimizer: Any) -> int:
    """Per-element state tensors ``optimizer`` keeps for each parameter it updates: Adam and
    AdamW two moments (three with amsgrad), SGD one momentum buffer (none without momentum);
    two for any other optimizer, as Adam's."""
    if optimizer is None:
        return 0
    defaults = getattr(optimizer, "defaults", {})
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if defaults.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if defaults.get("amsgrad", False) else 2
    return 2


def state_part_nbytes(shard: Shard, state_dtype: str, widened: bool = False) -> int:
    """Bytes of one state tensor of ``shard`` as stored: fp32 state in ``state_dtype``, state in
    another dtype (a master that is not fp32, updated as it is) as it is. ``widened``: bf16
    masters updated in fp32 (precision.master_dtype), whose state is fp32."""
    if shard.dtype == torch.float32 or (widened and shard.dtype.is_floating_point):
        return stored_nbytes(state_dtype, shard.numel)
    return shard.nbytes


def plan_disk(
    entries: Iterable[ParamEntry],
    *,
    trained: set[int] | None,
    masters_on_nvme: bool,
    state_on_nvme: bool,
    compute_dtype: torch.dtype | None,
    grads_stored: bool,
    state_tensor_count: int,
    state_dtype: str,
    extent: Callable[[int], int],
    widened: bool = False,
) -> DiskBytes:
    """The bytes a run stores on NVMe (see the module docstring). ``trained``: the entries the
    optimizer updates (None: no optimizer, nothing trained); ``compute_dtype``: the compute
    copies' dtype (None: none kept); ``grads_stored``: updates may run in
    ``optimizer.step()`` (step_in_backward False or 'auto', whose first step runs there and
    stores every gradient; True stores none); ``extent``: bytes of the swap files an extent of
    so many bytes takes; ``widened``: bf16 masters updated in fp32 (their state is fp32).

    Gradients stay in the master's dtype: they are accumulated there (several backward passes,
    the loss scale taken out), which in bf16 would round each sum to 8 bits of mantissa; a
    gradient kept for the step costs its bytes only in runs that update in ``optimizer.step()``.
    """
    sums = dict.fromkeys(KINDS, 0)
    for entry in entries:
        is_trained = trained is not None and entry.index in trained
        for shard in entry.shards:
            if masters_on_nvme:
                sums["masters" if is_trained else "frozen"] += extent(shard.nbytes)
                if (
                    is_trained
                    and compute_dtype is not None
                    and shard.dtype.is_floating_point
                    and compute_dtype.itemsize < shard.dtype.itemsize
                ):
                    sums["compute"] += extent(shard.numel * compute_dtype.itemsize)
            if not state_on_nvme or trained is None:
                continue
            # A parameter that requires a gradient but is in no param group still gets one.
            if grads_stored and (is_trained or entry.requires_grad):
                sums["grads"] += extent(shard.nbytes)
            if is_trained:
                part = state_part_nbytes(shard, state_dtype, widened)
                sums["state"] += state_tensor_count * extent(part)
    return DiskBytes(**sums)


def stored_on_disk(
    entries: Iterable[ParamEntry], trained: set[int] | None, extent_bytes: Callable[[Any], int]
) -> DiskBytes:
    """The bytes the shards' extents hold now, by kind (``extent_bytes``: an extent's bytes in
    the swap files)."""
    sums = dict.fromkeys(KINDS, 0)
    kinds = {
        ShardKind.COMPUTE: "compute",
        ShardKind.GRAD: "grads",
        ShardKind.OPTIM: "state",
    }
    for entry in entries:
        is_trained = trained is not None and entry.index in trained
        for shard in entry.shards:
            if shard.extent is not None:
                sums["masters" if is_trained else "frozen"] += extent_bytes(shard.extent)
            for companion in shard.companions.values():
                if companion.extent is not None:
                    sums[kinds.get(companion.kind, "state")] += extent_bytes(companion.extent)
    return DiskBytes(**sums)


def release_gradient_space(registry: ShardRegistry, engine: Any) -> int:
    """Frees the extents of gradients consumed (their companions empty), when updates move
    into backward and store gradients no more ('auto' after its first step): the swap files
    give their blocks back. A step back in ``optimizer.step()`` allocates them again as it
    writes. Returns the bytes freed."""
    freed = 0
    if engine is None:
        return freed
    with registry.lock:
        for shard in registry.shards.values():
            holder = shard.companions.get(GRAD_KEY)
            if (
                holder is None
                or holder.extent is None
                or holder.state is not Residency.EMPTY
                or holder.pending is not None
            ):
                continue
            extent, holder.extent = holder.extent, None
            engine.free(extent)
            freed += extent.nbytes
    return freed
