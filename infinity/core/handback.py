"""What ``TieredStore.close()`` gives back to the model (``restore_params``), and how.

A model larger than RAM cannot be handed back whole into RAM, so ``close`` gives back what the
caller chose (:func:`choose`): every parameter, none, those that fit ('auto'), or the ones named.
The rest go to the meta device (:func:`leave_on_meta`), honest about having no values, and a
warning says where their values are (:func:`where_values_are`).

:func:`hand_back` keeps close's peak near the larger of the staging arena and the parameters,
not their sum: the device tier goes first (its copies are never newer than the masters), then
what will not be read again (optimizer state, gradients, the masters not given back), and each
parameter's slots are freed once it has its values, while the arena's free slots hand their
pages back to the system as they empty.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infinity.core.residency import Residency as R
from infinity.core.shards import ParamEntry, ShardRegistry
from infinity.core.tiers import HostTier
from infinity.errors import BudgetError, ConfigError

if TYPE_CHECKING:
    from infinity.core.placement import Placement

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Declined:
    """'auto' found the parameters too large to give back: their bytes, and the room."""

    nbytes: int
    room: int
    what: str


def choose(
    choice: bool | str | Iterable[Any],
    *,
    registry: ShardRegistry,
    uninitialised: set[int],
    model: nn.Module,
    room: Callable[[], tuple[int, str]],
    refuse_too_large: bool,
    agree: Callable[[int], int] | None = None,
) -> tuple[set[int], Declined | None]:
    """The indices of the entries to give back for ``choice`` (see ``TieredStore.close``), and
    what 'auto' declined. ``room()``: the bytes that may be given back and what bounds them;
    ``refuse_too_large``: True that does not fit raises (a host budget says how much fits);
    ``agree``: across ranks, the minimum over every rank (they must decide alike)."""
    entries = [e for e in registry.entries if e.index not in uninitialised]
    if isinstance(choice, bool) or choice == "auto":
        nbytes = sum(e.numel * (e.given_dtype or e.dtype).itemsize for e in entries)
        limit, what = room()
        fits = nbytes <= limit
        if agree is not None:
            fits = bool(agree(int(fits)))
        if choice is True and not fits and refuse_too_large:
            raise BudgetError(
                f"close(restore_params=True) would hand back {nbytes} bytes of parameters, "
                f"more than {what} ({limit} bytes): close(restore_params=False) leaves them on "
                f"the meta device (save a checkpoint first to keep their values), or pass the "
                f"parameters or modules to hand back"
            )
        if choice is False or not fits:
            declined = Declined(nbytes, limit, what) if choice == "auto" and entries else None
            return set(), declined
        return {e.index for e in entries}, None
    if isinstance(choice, (str, nn.Module, torch.Tensor)):
        choice = [choice]
    if not isinstance(choice, Iterable):
        raise ConfigError(
            f"restore_params={choice!r} is invalid: expected True, False, 'auto', or "
            f"parameters, modules or parameter names of the attached model"
        )
    names = dict(model.named_parameters(remove_duplicate=False))
    chosen: set[int] = set()
    for item in choice:
        params: list[torch.Tensor]
        if isinstance(item, str):
            param = names.get(item)
            if param is None:
                close = difflib.get_close_matches(item, list(names), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"restore_params: {item!r} is not a parameter of the attached model{hint}"
                )
            params = [param]
        elif isinstance(item, nn.Module):
            params = list(item.parameters())
        elif isinstance(item, torch.Tensor):
            params = [item]
        else:
            raise ConfigError(
                f"restore_params: {item!r} is not a parameter, a module or a parameter name"
            )
        for tensor in params:
            entry = registry.entry_of(tensor)
            if entry is None:
                raise ConfigError(
                    f"restore_params: a parameter of shape {tuple(tensor.shape)} is not "
                    f"attached to this store"
                )
            if entry.index not in uninitialised:
                chosen.add(entry.index)
    return chosen, None


def hand_back(
    chosen: set[int],
    *,
    registry: ShardRegistry,
    placement: Placement,
    device: torch.device,
    materialize: Callable[[ParamEntry], torch.Tensor],
    same_order_everywhere: bool,
) -> tuple[list[ParamEntry], BaseException | None]:
    """Gives the ``chosen`` entries their values back; returns the entries attach took over
    that did not get them (not chosen, never initialised, or failed), and the first failure.
    ``same_order_everywhere``: across ranks each read is a collective, so the entries go in
    registry order rather than those already in the arena first."""
    for entry in list(placement.copies.on_device):
        entry.holds = 0  # the passes that held it are over
        placement.drop_device(entry, force=True)
    placement.device.close()
    adopted = [e for e in registry.entries if e.device_tensor is not None]
    restoring = [
        e
        for e in adopted
        if e.index in chosen
        and e.index not in placement.uninitialised
        and e.shards
        and e.shards[0].state is not R.EMPTY
    ]
    keep = {e.index for e in restoring}
    for shard in registry.shards.values():
        for companion in shard.companions.values():
            placement.discard(companion)
        if shard.entry.index not in keep:
            placement.discard(shard)
    placement.host.release_free_pages()
    if not same_order_everywhere:
        # Those already in the arena first: their slots free the room the others' reads need.
        restoring.sort(key=lambda e: not all(s.state.on_host for s in e.shards))
    failure: BaseException | None = None
    restored: set[int] = set()
    for entry in restoring:
        try:
            entry.param.data = materialize(entry).to(device, entry.given_dtype or entry.dtype)
            restored.add(entry.index)
        except Exception as exc:
            log.error("close: %s could not be restored: %s", entry.name, exc)
            failure = failure or exc
        for shard in entry.shards:
            placement.discard(shard)
    return [e for e in adopted if e.index not in restored], failure


def leave_on_meta(model: nn.Module, entries: list[ParamEntry]) -> None:
    """Parameters not given back go to the meta device: honest about having no values, and no
    empty storage left behind (tied ones stay tied)."""
    if not entries:
        return
    meta = {
        id(e.param): nn.Parameter(
            torch.empty(e.shape, dtype=e.given_dtype or e.dtype, device="meta"),
            requires_grad=e.param.requires_grad,
        )
        for e in entries
    }
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in meta:
                module._parameters[name] = meta[id(param)]


def forget_host_views(
    registry: ShardRegistry, optimizer_state: Iterable[dict[str, Any]], host: HostTier
) -> None:
    """Drops every view of the staging arena the store made (host copies, gradients, optimizer
    state bound to it), so that closing the host tier unmaps the arena now rather than when the
    store object goes."""
    for shard in registry.shards.values():
        for part in [shard, *shard.companions.values()]:
            part.host = None
            part.arena_offset = None
            part.grad = None
    for state in optimizer_state:
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and host.holds_address(value.data_ptr()):
                state[key] = torch.empty(0, dtype=value.dtype)


def where_values_are(
    last_checkpoint: tuple[Any, int] | None, steps: int, keep_swap_files: bool
) -> str:
    """For close's warning: where the values not given back can be found."""
    if last_checkpoint is not None:
        path, saved_after = last_checkpoint
        later = steps - saved_after
        return (
            f"in the checkpoint {path}, saved after step {saved_after}"
            + (f" ({later} later step(s) are not in it)" if later else "")
            + ": attach a new store and load_checkpoint() it"
        )
    if keep_swap_files:
        return "in the kept swap files (keep_swap_files)"
    return (
        "discarded: call store.save_checkpoint(path) before close(), or pass "
        "close(restore_params=...) the parameters or modules to hand back"
    )


__all__ = [
    "Declined",
    "choose",
    "forget_host_views",
    "hand_back",
    "leave_on_meta",
    "where_values_are",
]


def values_of(entry: ParamEntry, placement: Placement) -> torch.Tensor:
    """The parameter's current values as a new host tensor of its shape (a quantized weight
    decoded, in the dtype it computes in)."""
    out = torch.empty(entry.shape, dtype=entry.compute_dtype if entry.quantized else entry.dtype)
    flat = out.view(-1)
    if entry.resident:
        placement.settle(entry)
        assert entry.device_tensor is not None  # resident
        flat.copy_(entry.device_tensor.reshape(-1))
        return out
    for shard in entry.shards:
        placement.ensure_host(shard)
        host = shard.host
        assert host is not None  # ensured
        if shard.piece is None:
            shard.values_into(flat[shard.start : shard.start + shard.numel], host)
        else:  # every rank's slice: a collective, on every rank
            partition = placement.partition
            assert partition is not None  # only partitioned shards have pieces
            start, numel = shard.piece
            flat[start : start + numel].copy_(partition.gather_flat(host, numel))
    return out
