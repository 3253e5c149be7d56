"""The gradient path and what the user's loop sees of a gradient: a finished device gradient
goes into its shard's host accumulator, or into a gradient companion that the placement keeps
(and swaps to NVMe) like any shard; norms, factors the loop applies, reads and replacements.

:class:`Gradients` is a part of :class:`infinity.core.placement.Placement` with its own state
(the gradient bytes held, the loss scale, whether norms are kept); what it needs of the
placement (companion slots, reaping) is :class:`GradientSlots`. Like the placement it runs on
the training thread.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from infinity.core.residency import Residency as R
from infinity.core.shards import GRAD_KEY, ParamEntry, Shard, ShardRegistry
from infinity.core.streams import CompletionQueue
from infinity.core.tiers import DeviceTier, HostTier
from infinity.core.timeline import Timeline

if TYPE_CHECKING:
    from infinity.ranks.partition import Partition

log = logging.getLogger(__name__)


class GradientSlots(Protocol):
    """What the gradient path needs of the placement: gradient companions and their slots."""

    @property
    def update_in_backward(self) -> bool: ...

    def companion(self, shard: Shard, key: str, numel: int, dtype: torch.dtype) -> Shard: ...

    def fill(self, shard: Shard, source: torch.Tensor | None = None) -> torch.Tensor: ...

    def discard(self, shard: Shard) -> None: ...

    def ensure_host(self, shard: Shard, protect: Iterable[Shard] = ()) -> None: ...

    def reap(self, shard: Shard, wait: bool = False) -> BaseException | None: ...


class Gradients:
    """Gradients of the attached parameters, wherever their bytes are (see the module
    docstring)."""

    def __init__(
        self,
        slots: GradientSlots,
        registry: ShardRegistry,
        device: DeviceTier,
        host: HostTier,
        *,
        grads_on_nvme: bool,
        track_norms: bool,
        loss_scale: float,
        partition: Partition | None,
        timeline: Timeline,
    ) -> None:
        self._slots = slots
        self.registry = registry
        self.device = device
        self.host = host
        #: gradients go into companions that are swapped to NVMe like any shard
        self.grads_on_nvme = grads_on_nvme
        self.partition = partition
        self.timeline = timeline
        #: bytes of gradients held in host tensors (not companions), and their peak
        self.grad_bytes = 0
        self.grad_peak = 0
        #: the loss scale gradients arrive multiplied by (fp16 dynamic scaling), divided out here
        self.loss_scale = loss_scale
        #: keep each shard's squared gradient norm (for clipping and overflow checks)
        self.track_grad_norms = track_norms
        #: entries whose gradient from backward is complete (reduced across ranks), with
        #: whether it came from a nested backward, not yet taken by ``completed``
        self._complete: list[tuple[ParamEntry, bool]] = []
        #: entry index -> shards whose reduction is still under way, and whether a gradient
        #: of a nested backward is among them
        self._reducing: dict[int, tuple[int, bool]] = {}
        #: a quantized weight's gradient was discarded, and said so
        self._warned_quantized = False
        #: with asynchronous copies (CUDA): gradients on their way off the device into pinned
        #: host buffers, and the host work (accumulation, norm, the report that lets an update
        #: in backward run) each one waits for; run at the next hook whose copies are done, all
        #: of it before anything reads a gradient (finish_reductions)
        self.arriving = CompletionQueue(device.streams)
        #: shard id -> its gradients in ``arriving`` (what _settle waits for)
        self._arriving_shards: dict[str, int] = {}

    def set_loss_scale(self, scale: float) -> None:
        """The loss scale the next gradients arrive multiplied by (fp16 dynamic scaling)."""
        self.loss_scale = scale

    def keep_norms(self) -> bool:
        """Keeps each shard's gradient norm from now on (a loop reads gradient norms); True if
        that is new."""
        started = not self.track_grad_norms
        self.track_grad_norms = True
        return started

    # -- gradients ---------------------------------------------------------------------------------
    def take_grad(
        self,
        entry: ParamEntry,
        grad: torch.Tensor,
        unscale: bool = True,
        reduce: bool = True,
        report: bool = False,
        nested: bool = False,
    ) -> None:
        """Moves a finished device gradient into the entry's shards' host accumulators (fp32
        master dtype), dividing out the loss scale (``unscale``: it came from backward) and
        keeping each shard's squared norm when norms are tracked (clipping, overflow checks,
        a loop that reads gradient norms). Across several ranks the gradient is this rank's
        and is averaged over the ranks (``reduce``) before this rank keeps its slices; without
        ``reduce`` it is already the average (a gradient the loop assigned). ``report``: once
        every shard has its part (across ranks, once their reductions landed), the entry is
        among the :meth:`completed` ones (an update in backward waits for it), with
        ``nested`` (a gradient of a nested backward, which more may follow)."""
        if entry.quantized:
            # Stored rounded for inference: nothing could apply a gradient to it. Backward to
            # the inputs (attributions) still runs; the weight's own gradient is dropped.
            if not self._warned_quantized:
                self._warned_quantized = True
                log.warning(
                    "'%s' is stored quantized (precision.storage_dtype int8/int4, for "
                    "inference): its gradient is discarded (p.grad stays None), as are those of "
                    "the other quantized weights; run the model under torch.no_grad(), or call "
                    "requires_grad_(False) on its weights, to not compute them",
                    entry.name,
                )
            if report:
                self._complete.append((entry, nested))
            return
        scale = self.loss_scale if unscale else 1.0
        self.arriving.poll()
        started = time.perf_counter()
        flat = grad.detach().reshape(-1)
        reducing = 0
        for shard in entry.shards:
            if shard.piece is not None and reduce:
                # Averaged over the ranks in its bucket's collective, in the background
                # (overlap_comm); accumulated once the reduction completes, in the order the
                # reductions started.
                assert self.partition is not None  # only partitioned shards have pieces
                start, numel = shard.piece
                reducing += 1
                self.partition.reducer.add(
                    shard,
                    flat[start : start + numel],
                    functools.partial(self._reduced, shard, scale=scale, report=report),
                )
                continue
            if self.device.asynchronous:
                self._send_to_host(shard, self._own_part(flat, shard), scale)
            else:
                self._accumulate_grad(shard, self._own_part(flat, shard), scale)
        self.timeline.span(entry.name, "d2h", started, time.perf_counter())
        if report:
            if reducing:
                count, was_nested = self._reducing.get(entry.index, (0, False))
                self._reducing[entry.index] = (count + reducing, was_nested or nested)
            else:
                # After the host work of its shards (the queue keeps their order).
                self.arriving.add(
                    None, lambda: self._complete.append((entry, nested)), f"report {entry.name}"
                )

    def _send_to_host(self, shard: Shard, piece: torch.Tensor, scale: float) -> None:
        """Starts ``piece`` (the shard's part of a device gradient) on its way into a pinned
        host buffer on the copy stream, in its own dtype (a bf16 gradient crosses as bf16 and
        is converted on the host, from pinned memory); its accumulation runs once the copy's
        event has completed (``arriving``), while the device computes on."""
        if scale != 1.0:
            piece = piece.to(shard.dtype) / scale  # unscaled on the device, where it is
        staged = self.host.scratch(tuple(piece.shape), piece.dtype)
        event = self.device.copy_out_async(staged, piece)
        pending = self._arriving_shards
        pending[shard.id] = pending.get(shard.id, 0) + 1

        def land() -> None:
            left = pending.pop(shard.id) - 1
            if left:
                pending[shard.id] = left
            self._accumulate_grad(shard, staged, 1.0, on_host=True)

        self.arriving.add(event, land, f"grad {shard.id}")

    def _settle(self, shard: Shard) -> None:
        """Runs the host work of the gradients still arriving, where some of it is
        ``shard``'s (before the shard's gradient is read, dropped or moved)."""
        if shard.id in self._arriving_shards:
            self.arriving.drain()

    def _reduced(self, shard: Shard, piece: torch.Tensor, scale: float, report: bool) -> None:
        """A reduction landed: this rank's averaged slice of ``shard``'s gradient."""
        self._accumulate_grad(shard, piece, scale)
        if not report:
            return
        entry = shard.entry
        count, nested = self._reducing.pop(entry.index, (1, False))
        if count > 1:
            self._reducing[entry.index] = (count - 1, nested)
        else:
            self._complete.append((entry, nested))

    def completed(self) -> list[tuple[ParamEntry, bool]]:
        """The entries whose gradient from backward became complete since the last call (taken
        with ``report``), each with whether a nested backward produced it, in the order they
        completed."""
        self.arriving.poll()
        out, self._complete = self._complete, []
        return out

    def finish_reductions(self) -> None:
        """Completes the gradient reductions under way across ranks (end of backward, and
        before anything reads a gradient), and the host work of gradients still on their way
        off the device."""
        self.arriving.drain()
        if self.partition is not None:
            self.partition.finish_reductions()

    def _accumulate_grad(
        self, shard: Shard, piece: torch.Tensor, scale: float, on_host: bool = False
    ) -> None:
        """Adds ``piece`` (the shard's part of a new gradient, times ``scale``) to its
        accumulated gradient. ``on_host``: ``piece`` is a host buffer the store may keep (a
        device gradient that arrived, see ``_send_to_host``)."""
        host = on_host or self.device.host_memory
        if scale != 1.0:
            piece = piece.to(shard.dtype) / scale  # unscale before accumulating
        if shard.grad_scale != 1.0 and self.has_grad(shard):
            # The loop scaled the gradient so far (p.grad.mul_): do it before adding more.
            self.apply_grad_multiplier(shard, self._grad_for_write(shard), 1.0)
        if not self.grads_on_nvme or self._updated_right_away(shard, piece):
            if shard.grad is None and host and piece.dtype == shard.dtype and piece.is_contiguous():
                # A gradient computed in host memory (no GPU), or one that arrived in a host
                # buffer, already is a host tensor: keep it instead of copying it (the hook
                # drops param.grad right after).
                self._hold_grad(shard, piece)
            elif shard.grad is None:
                held = self.host.scratch(shard.numel, shard.dtype)
                self._hold_grad(shard, held)
                self._copy_into(held, piece, on_host)
            else:
                shard.grad.add_(self._on_host(piece, shard.grad.dtype, on_host))
            target = shard.grad
            assert target is not None  # held above
        else:
            target = self._grad_companion_for_write(shard)
            if target is None:
                holder = self._slots.companion(shard, GRAD_KEY, shard.numel, shard.dtype)
                target = self._slots.fill(holder)
                self._copy_into(target, piece, on_host)
            else:
                target.add_(self._on_host(piece, target.dtype, on_host))
        shard.grad_scale = 1.0
        shard.grad_sq_norm = _sq_norm(target) if self.track_grad_norms else None

    @staticmethod
    def _own_part(flat: torch.Tensor, shard: Shard) -> torch.Tensor:
        """``shard``'s part of the flat gradient ``flat``: its range, or, partitioned across
        ranks, its slice of ``flat`` padded with zeros (a gradient that is already the
        average over the ranks)."""
        if shard.piece is None:
            return flat[shard.start : shard.start + shard.numel]
        return shard.padded(shard.part_of(flat))

    # -- what the user's loop sees of a gradient (infinity.training.grad_view) ---------------------
    def global_sq_norms(self, groups: list[list[Shard]]) -> list[float]:
        """For each group of shards, the squared norm of their gradients as the loop sees them,
        over every rank's slices (one collective for all groups)."""
        self.finish_reductions()
        local = [math.fsum(self.grad_sq_norm(s) for s in group) for group in groups]
        if self.partition is None:
            return local
        return self.partition.sum_across(local)

    def grad_sq_norm(self, shard: Shard) -> float:
        """The squared L2 norm of the shard's gradient as the loop sees it (its recorded factor
        applied); computed from the gradient, read back if need be, when it was not tracked."""
        self._settle(shard)
        if shard.grad_scale == 0.0 or not self.has_grad(shard):
            return 0.0
        if shard.grad_sq_norm is None:
            shard.grad_sq_norm = _sq_norm(self._grad_for_read(shard))
        return shard.grad_sq_norm * shard.grad_scale**2

    def read_grad(self, entry: ParamEntry) -> torch.Tensor:
        """The entry's gradient as a new host tensor of the parameter's shape (master dtype),
        read through the tiers, with the recorded factor applied."""
        self.finish_reductions()
        out = torch.zeros(entry.shape, dtype=entry.dtype)
        flat = out.view(-1)
        for shard in entry.shards:
            if shard.piece is not None:
                # Every rank holds a slice: assemble the whole (a collective, on every rank).
                local = torch.zeros(shard.numel, dtype=entry.dtype)
                if self.has_grad(shard) and shard.grad_scale != 0.0:
                    local.copy_(self._grad_for_read(shard))
                    if shard.grad_scale != 1.0:
                        local.mul_(shard.grad_scale)
                assert self.partition is not None  # only partitioned shards have pieces
                start, numel = shard.piece
                flat[start : start + numel].copy_(self.partition.gather_flat(local, numel))
                continue
            if not self.has_grad(shard):
                continue
            piece = flat[shard.start : shard.start + shard.numel]
            if shard.grad_scale == 0.0:
                continue  # zeroed (p.grad.zero_()): zeros, whatever was there (NaN too)
            piece.copy_(self._grad_for_read(shard))
            if shard.grad_scale != 1.0:
                piece.mul_(shard.grad_scale)
        return out

    def replace_grad(
        self, entry: ParamEntry, value: torch.Tensor | None, same_gradient: bool = False
    ) -> None:
        """Makes ``value`` (a host tensor of the parameter's shape that the store may keep, or
        None) the entry's gradient, as assigning ``p.grad`` does. ``same_gradient``: the result
        of an in-place op on the gradient, so views of it stay current."""
        self.finish_reductions()
        generation = entry.grad_generation
        for shard in entry.shards:
            self.drop_grad(shard)
        if value is not None:
            self.take_grad(entry, value, unscale=False, reduce=False)
            self.arriving.drain()  # the loop reads what it assigned right away
        if same_gradient:
            entry.grad_generation = generation

    def apply_grad_multiplier(self, shard: Shard, grad: torch.Tensor, multiplier: float) -> None:
        """Multiplies the host gradient ``grad`` of ``shard`` in place by ``multiplier`` times
        the factor the loop recorded, which is then done."""
        factor = self.take_grad_factor(shard, multiplier)
        if factor == 0.0:
            grad.zero_()  # as p.grad.zero_() would: NaN and inf included
        elif factor != 1.0:
            grad.mul_(factor)

    def take_grad_factor(self, shard: Shard, multiplier: float) -> float:
        """``multiplier`` times the factor the loop recorded on ``shard``'s gradient, which the
        caller applies (0: zeroes it, NaN and inf included): the factor is then done."""
        factor = multiplier * shard.grad_scale
        shard.grad_scale = 1.0
        if factor == 0.0:
            shard.grad_sq_norm = 0.0
        elif factor != 1.0 and shard.grad_sq_norm is not None:
            shard.grad_sq_norm *= factor * factor
        return factor

    def _grad_for_read(self, shard: Shard) -> torch.Tensor:
        """The shard's host gradient (its companion read back when it is on NVMe)."""
        if shard.grad is not None:
            return shard.grad
        holder = shard.companions[GRAD_KEY]
        self._slots.ensure_host(holder)
        assert holder.host is not None  # ensured
        return holder.host

    def _grad_for_write(self, shard: Shard) -> torch.Tensor:
        if shard.grad is not None:
            return shard.grad
        target = self._grad_companion_for_write(shard)
        assert target is not None
        return target

    def _updated_right_away(self, shard: Shard, piece: torch.Tensor) -> bool:
        """With gradients on NVMe: whether ``shard``'s gradient stays in a host tensor, because
        its update in backward uses it right after this. Only a gradient computed in host
        memory (no GPU) with no part already in the companion: copying it into a companion
        would only pay if the update had to wait (then park_grads moves it there)."""
        return (
            self._slots.update_in_backward
            and shard.step_param is not None
            and self.device.host_memory
            and not self._has_grad_companion(shard)
        )

    def _hold_grad(self, shard: Shard, tensor: torch.Tensor) -> None:
        shard.grad = tensor
        self.grad_bytes += shard.nbytes
        self.grad_peak = max(self.grad_peak, self.grad_bytes)

    def _release_grad(self, shard: Shard) -> None:
        if shard.grad is not None:
            shard.grad = None
            self.grad_bytes -= shard.nbytes

    def _copy_into(self, target: torch.Tensor, piece: torch.Tensor, on_host: bool) -> None:
        """``piece`` into the host tensor ``target`` (off the device, unless ``on_host``)."""
        if on_host:
            target.copy_(piece)
        else:
            self.device.copy_out(target, piece)

    def _on_host(
        self, piece: torch.Tensor, dtype: torch.dtype, on_host: bool = False
    ) -> torch.Tensor:
        """``piece`` as a host tensor of ``dtype`` to accumulate from (copied off a GPU)."""
        if on_host or self.device.host_memory:
            return piece.to(dtype)
        out = self.host.scratch(tuple(piece.shape), dtype)
        self.device.copy_out(out, piece)
        return out

    def _grad_companion_for_write(self, shard: Shard) -> torch.Tensor | None:
        """The host view of an existing gradient to accumulate into (read back if needed),
        marked dirty; None when the shard has no gradient yet."""
        holder = shard.companions.get(GRAD_KEY)
        if holder is None or holder.state is R.EMPTY:
            return None
        self._slots.ensure_host(holder)
        if holder.state is R.HOST_STORING:
            self._slots.reap(holder, wait=True)
        if holder.state is R.HOST_NVME:
            self.registry.set_state(holder, R.HOST)
        return holder.host

    def _has_grad_companion(self, shard: Shard) -> bool:
        holder = shard.companions.get(GRAD_KEY)
        return holder is not None and holder.state is not R.EMPTY

    def has_grad(self, shard: Shard) -> bool:
        # With grads_on_nvme, shard.grad holds a gradient kept for an update in backward.
        return shard.grad is not None or (self.grads_on_nvme and self._has_grad_companion(shard))

    def grad_in_companion(self, shard: Shard) -> bool:
        """Whether the shard's gradient lives in its gradient companion (a slot the step must
        read and give back), rather than in a host tensor."""
        return self.grads_on_nvme and shard.grad is None

    def park_grads(self, entry: ParamEntry) -> None:
        """Moves gradients kept for an update in backward that has to wait (for
        ``optimizer.step()``) into their companions, where they count in the host budget and
        can be swapped."""
        if not self.grads_on_nvme:
            return
        for shard in entry.shards:
            self._settle(shard)
            if shard.grad is None:
                continue
            holder = self._slots.companion(shard, GRAD_KEY, shard.numel, shard.dtype)
            self._slots.fill(holder, source=shard.grad)
            self._release_grad(shard)

    def grad_view(self, shard: Shard) -> torch.Tensor | None:
        """The shard's host gradient (its companion must already be on the host)."""
        self._settle(shard)
        if shard.grad is not None:
            return shard.grad
        if self.grads_on_nvme:
            holder = shard.companions.get(GRAD_KEY)
            if holder is None or holder.state is R.EMPTY:
                return None
            return holder.host
        return shard.grad

    def drop_grad(self, shard: Shard) -> None:
        """Forgets one shard's gradient (consumed by the step)."""
        self._settle(shard)
        self._forget_grad(shard)
        self._release_grad(shard)
        if self.grads_on_nvme:
            holder = shard.companions.get(GRAD_KEY)
            if holder is not None:
                self._slots.discard(holder)

    def clear_grads(self, set_to_none: bool = True) -> None:
        self.finish_reductions()  # gradients still arriving land first, then go
        self._complete.clear()  # nothing left to update in backward: the gradients are gone
        for shard in self.registry.shards.values():
            self._forget_grad(shard)
            if self.grads_on_nvme:
                holder = shard.companions.get(GRAD_KEY)
                if holder is not None:
                    self._slots.discard(holder)
            # With gradients on NVMe a host tensor is one kept for an update in backward that
            # did not run: always dropped.
            if set_to_none or self.grads_on_nvme:
                self._release_grad(shard)
            elif shard.grad is not None:
                shard.grad.zero_()
                shard.grad_sq_norm = 0.0

    @staticmethod
    def _forget_grad(shard: Shard) -> None:
        shard.grad_sq_norm = None
        shard.grad_scale = 1.0
        shard.entry.grad_generation += 1


def _sq_norm(grad: torch.Tensor) -> float:
    # vector_norm reduces without a full-size temporary (a float64 copy would be 2x the
    # gradient); its fp32 accumulation is accurate enough for clipping and overflow, and a
    # whole parameter's norm is then the very value torch computes for it.
    if not grad.is_floating_point():
        return 0.0
    return float(torch.linalg.vector_norm(grad)) ** 2
