"""ZeRO across data-parallel ranks: this rank's slice of every shard, and the collectives that
assemble a module's parameters from the slices and reduce gradients back into them.

Every shard (a flat piece of a parameter, at most ``buffer_size`` bytes) is padded to a multiple
of the world size; rank ``r`` owns the ``r``-th of ``world`` equal, contiguous slices. The
registry keeps only that slice as the shard (``Shard.start``/``numel``, with ``Shard.piece``
naming the whole piece), so the tiers, the swap files and the optimizer step see nothing but
this rank's bytes: each rank holds and swaps 1/N of the training state.

- **Buckets** (:mod:`infinity.ranks.buckets`, decided at attach by :meth:`Partition.plan`):
  which shards travel together, so that a step makes about one collective per module and
  pass instead of one per shard.
- **Fetch**: the slices come up the tiers as before (NVMe -> arena -> device), then one
  all-gather per bucket assembles the whole pieces in the parameters' device copies
  (:class:`~infinity.ranks.collectives.BucketGather`).
- **Gradients** (``reducer``, :class:`~infinity.ranks.collectives.GradientBuckets`): a bucket
  of whole gradients is reduce-scattered (stage 2 and 3) or all-reduced (stage 1) in the
  masters' dtype and averaged; each rank keeps its slices.
- **Norms** (``sum_across``): per-slice squared norms are summed over the ranks.
- **Stages**: 3 partitions parameters, gradients and optimizer state; 1 and 2 keep every
  parameter whole on each rank's device (the working copies are persistent), while masters,
  gradients and optimizer state stay partitioned and the updated slices are all-gathered into
  the working copies after the step.

Collectives are issued in the same order on every rank because the decisions that trigger them
are the same everywhere: the module order, the device tier's budget and eviction (a function of
the trace and the budget, identical on all ranks), the autograd order of gradient hooks and the
entry order of the step. Only torch.distributed collectives are used (gloo on CPU, NCCL on
CUDA). A collective that fails (a rank died, the process group's timeout passed) raises
:class:`~infinity.errors.RankError` naming the operation; the store's exit cleanup removes this
rank's swap files.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from infinity.errors import AttachError, RankError
from infinity.ranks.buckets import BucketLayout
from infinity.ranks.collectives import GradientBuckets, ScratchBuffers

if TYPE_CHECKING:
    from infinity.core.shards import ParamEntry

log = logging.getLogger(__name__)

# torch 2.13 names them *_single (the *_tensor names are deprecated there); older torch has
# only the *_tensor ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes each rank sent into collectives, the collectives by kind, and the seconds the
    training thread waited for them."""

    gathered_bytes: int = 0
    reduced_bytes: int = 0
    gather_seconds: float = 0.0
    reduce_seconds: float = 0.0
    #: every collective: all-gathers, reductions and the small ones (norms, broadcasts)
    collectives: int = 0
    #: all-gathers of parameters (buckets, and single pieces read outside the hooks)
    all_gathers: int = 0
    #: reductions of gradients (reduce-scatters, or all-reduces at stage 1)
    reductions: int = 0


class Partition:
    """This rank's place in the data-parallel group; see the module docstring."""

    def __init__(self, group: Any, stage: int) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.stage = stage
        #: the global rank that broadcasts initial values (the group's rank 0)
        self.source = dist.get_global_rank(group, 0) if group is not None else 0
        self.backend = dist.get_backend(group)
        #: collectives on CUDA tensors under NCCL; host tensors under gloo
        self.on_device = self.backend == "nccl"
        self.stats = CommStats()
        #: the buckets, and the gradient reductions (made by ``plan`` at attach)
        self.layout: BucketLayout | None = None
        self._reducer: GradientBuckets | None = None
        self.scratch = ScratchBuffers(0)
        #: bytes of gradient reductions left under way while compute goes on (overlap_comm)
        self._in_flight = 0
        #: a collective failed: the other ranks cannot be relied on any more (close() then
        #: gives nothing back, which would need them)
        self.failed = False

    @classmethod
    def of(cls, group: Any, stage: int) -> Partition | None:
        """The partition for ``group`` (None: the default group), or None when there is no
        process group or it has one rank (everything then runs as a single process)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_world_size(group) <= 1:
            return None
        return cls(group, stage)

    @classmethod
    def join(cls, process_group: Any, config: Any, device: torch.device) -> Partition | None:
        """This rank's partition under a process group of several ranks (None otherwise), after
        refusing what cannot run across ranks."""
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise AttachError(
                "attach(process_group=...) needs torch.distributed initialised: "
                "call dist.init_process_group() first"
            )
        partition = cls.of(process_group, config.zero_stage)
        if partition is None:
            return None
        where = partition.describe()
        if partition.stage < 3 and config.offload_param != "none":
            raise AttachError(
                f"{where}: zero_stage={partition.stage} keeps every parameter whole on each "
                f"rank's device, so offload_param={config.offload_param!r} cannot apply: use "
                f"zero_stage=3 to partition and offload parameters, or offload_param='none' "
                f"(masters and optimizer state stay partitioned, on offload_optimizer's tier)"
            )
        if device.type == "cuda" and partition.backend != "nccl":
            raise AttachError(
                f"{where}: compute on {device} needs the nccl backend; init_process_group('nccl')"
            )
        if device.type == "cpu" and partition.on_device:
            raise AttachError(f"{where}: device='cpu' needs a process group on the gloo backend")
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            index = device.index if device.index is not None else torch.cuda.current_device()
            local = int(os.environ["LOCAL_RANK"]) % max(torch.cuda.device_count(), 1)
            if index != local:
                # Trainer and accelerate put rank r's model on cuda:LOCAL_RANK and would then
                # ask to move it off the store's device (refused).
                log.warning(
                    "%s: the store computes on cuda:%d but LOCAL_RANK is %s: call "
                    "torch.cuda.set_device(local_rank) before creating the store (or set "
                    "OffloadConfig(device=f'cuda:{local_rank}'))",
                    where,
                    index,
                    os.environ["LOCAL_RANK"],
                )
        partition._in_flight = config.reduce_bucket_size if config.overlap_comm else 0
        log.info("%s: each rank holds 1/%d of the training state", where, partition.world)
        return partition

    def check_same_model(self, entries: list[Any], config: Any) -> None:
        """Stops ranks that registered different parameters, or differ in the settings that
        decide the shards and when collectives happen, before their first collective."""
        layout = [(e.name, tuple(e.shape), str(e.dtype), e.requires_grad) for e in entries]
        self.agree("the model's parameters (names, shapes, dtypes)", _digest(layout))
        # Drives and host memory may differ between ranks; these may not.
        shared = {k: v for k, v in config.to_dict().items() if k in _SAME_ON_EVERY_RANK}
        self.agree(f"the config ({', '.join(sorted(shared))})", _digest(shared))

    def plan(
        self,
        entries: Sequence[ParamEntry],
        module_entries: Sequence[Sequence[ParamEntry]],
        persistent: frozenset[int],
        config: Any,
        device_budget: int,
    ) -> BucketLayout:
        """Decides the buckets (the same on every rank: every input is) and makes the gradient
        reductions over them. An all-gather bucket takes at most a quarter of the device
        budget, so that one fits beside the modules in use."""
        gather_bytes = max(1, min(config.allgather_bucket_size, device_budget // 4))
        layout = BucketLayout(
            entries,
            module_entries,
            persistent,
            self.world,
            gather_bytes,
            config.reduce_bucket_size,
        )
        self.layout = layout
        # Buffers kept for reuse: a few buckets' worth of each kind.
        self.scratch = ScratchBuffers(
            2 * gather_bytes + config.prefetch_bucket_size + 2 * config.reduce_bucket_size
        )
        self._reducer = GradientBuckets(self, layout, self._in_flight, self.scratch)
        log.info("%s: %s", self.describe(), layout.describe())
        return layout

    @property
    def reducer(self) -> GradientBuckets:
        """The gradient reductions (made at attach, by :meth:`plan`)."""
        assert self._reducer is not None, "Partition.plan() runs at attach, before gradients"
        return self._reducer

    def drives(self, paths: list[Path]) -> list[Path]:
        """The swap directories this rank uses: with at least as many as ranks on this node,
        its own share of them (ranks do not compete for a drive); with fewer, all of them,
        starting from a different one on each rank, so their stripes begin on different
        drives."""
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if len(paths) >= local_world > 1:
            return paths[local_rank % local_world :: local_world]
        first = local_rank % len(paths)
        return paths[first:] + paths[:first]

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world} ({self.backend}, ZeRO stage {self.stage})"

    # -- geometry -------------------------------------------------------------------------------
    def slice_of(self, start: int, numel: int) -> tuple[int, int, int]:
        """For the piece ``[start, start + numel)`` of a flat parameter: this rank's slice as
        (first element, slice length with padding, real elements in it)."""
        per_rank = -(-numel // self.world)
        first = start + self.rank * per_rank
        real = max(0, min(per_rank, start + numel - first))
        return first, per_rank, real

    # -- collectives ----------------------------------------------------------------------------
    def gather_into(self, out: torch.Tensor, local: torch.Tensor) -> Any:
        """Starts assembling one piece outside the buckets: every rank's ``local`` slice (equal
        lengths) end to end, the first ``out.numel()`` elements into ``out``. Returns a handle
        whose ``wait()`` completes it."""
        whole = local.numel() * self.world
        target = (
            out if out.numel() == whole else torch.empty(whole, dtype=out.dtype, device=out.device)
        )
        work = self.all_gather_async(target, local.contiguous())
        self.count_gather(local.numel() * local.element_size())
        return _Pending(self, work, None if target is out else (out, target))

    def gather_flat(self, local: torch.Tensor, numel: int) -> torch.Tensor:
        """The whole piece of ``numel`` elements from every rank's slice, blocking."""
        out = torch.empty(numel, dtype=local.dtype, device=local.device)
        self.gather_into(out, local).wait()
        return out

    def all_gather_async(self, out: torch.Tensor, local: torch.Tensor) -> Any:
        """Starts an all-gather of every rank's ``local`` into ``out`` (``local`` may be this
        rank's part of ``out``: in place)."""
        return self._call("all_gather", _ALL_GATHER, out, local, group=self.group, async_op=True)

    def count_gather(self, nbytes: int) -> None:
        self.stats.gathered_bytes += nbytes
        self.stats.collectives += 1
        self.stats.all_gathers += 1

    def wait_gather(self, work: Any) -> None:
        """Waits for an all-gather, counting the training thread's wait."""
        waited = time.perf_counter()
        try:
            work.wait()
        except Exception as exc:
            raise _rank_error(self, "all_gather", exc) from exc
        self.stats.gather_seconds += time.perf_counter() - waited

    def reduce_scatter_async(self, out: torch.Tensor, whole: torch.Tensor) -> Any:
        return self._call(
            "reduce_scatter", _REDUCE_SCATTER, out, whole, group=self.group, async_op=True
        )

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        return self._call("all_reduce", dist.all_reduce, tensor, group=self.group, async_op=True)

    def count_reduction(self, nbytes: int) -> None:
        self.stats.reduced_bytes += nbytes
        self.stats.collectives += 1
        self.stats.reductions += 1

    def wait_reduction(self, work: Any) -> None:
        """Waits for a gradient reduction, counting the training thread's wait."""
        waited = time.perf_counter()
        try:
            work.wait()
        except Exception as exc:
            raise _rank_error(
                self, "reduce_scatter" if self.stage > 1 else "all_reduce", exc
            ) from exc
        self.stats.reduce_seconds += time.perf_counter() - waited

    def finish_reductions(self) -> None:
        """Completes every gradient reduction (end of backward, before gradients are read)."""
        if self._reducer is not None:
            self._reducer.finish()

    def sum_across(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (float64)."""
        if not values:
            return []
        device = "cuda" if self.on_device else "cpu"
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        self._call("all_reduce", dist.all_reduce, tensor, group=self.group)
        self.stats.collectives += 1
        return tensor.tolist()

    def min_across(self, value: int) -> int:
        device = "cuda" if self.on_device else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        self._call("all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Overwrites ``tensor`` with the source rank's values (initial parameters: every rank
        starts from the same model, as DistributedDataParallel makes sure)."""
        if self.on_device and tensor.device.type != "cuda":
            moved = tensor.cuda()
            self._call("broadcast", dist.broadcast, moved, src=self.source, group=self.group)
            tensor.copy_(moved)
        else:
            self._call("broadcast", dist.broadcast, tensor, src=self.source, group=self.group)
        self.stats.collectives += 1

    def agree(self, what: str, value: Any) -> None:
        """Refuses to go on when ranks disagree on ``value`` (the model's layout): every rank
        must register the same shards, or their collectives would not match."""
        values: list[Any] = [None] * self.world
        self._call("all_gather_object", dist.all_gather_object, values, value, group=self.group)
        if any(v != values[0] for v in values):
            ranks = [r for r, v in enumerate(values) if v != values[0]]
            raise RankError(
                f"ranks disagree on {what}: rank(s) {ranks} differ from rank 0. "
                f"Every rank must attach the same model with the same config"
            )

    def _call(self, name: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except RankError:
            raise
        except Exception as exc:
            raise _rank_error(self, name, exc) from exc


class _Pending:
    """An all-gather of one piece under way; ``wait()`` completes it (and copies out of a
    padded buffer)."""

    def __init__(
        self, partition: Partition, work: Any, copy: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        self.partition = partition
        self.work = work
        self.copy = copy

    def wait(self) -> None:
        self.partition.wait_gather(self.work)
        if self.copy is not None:
            out, target = self.copy
            out.copy_(target[: out.numel()])


def _rank_error(partition: Partition, name: str, exc: BaseException) -> RankError:
    partition.failed = True
    if partition._reducer is not None:
        partition._reducer.abandon()
    partition.scratch.clear()
    timeout = _group_timeout(partition.group)
    return RankError(
        f"{name} failed on {partition.describe()}: {type(exc).__name__}: {exc}. Another rank "
        f"has most likely died or stopped (look at its output first){timeout}; this rank "
        f"stops too, and its swap files are removed when the process exits"
    )


def _group_timeout(group: Any) -> str:
    try:
        from torch.distributed.distributed_c10d import _get_default_group

        # ProcessGroup.options (its timeout) is not in torch's stubs
        timeout = (group or _get_default_group()).options._timeout  # type: ignore[union-attr]
        if isinstance(timeout, datetime.timedelta):
            return f", or the process group's timeout of {timeout.total_seconds():g} s passed"
    except Exception:
        pass
    return ""


#: config fields every rank must share: they decide the shards and when collectives happen
_SAME_ON_EVERY_RANK = frozenset(
    {
        "device_budget",
        "buffer_size",
        "param_persistence_threshold",
        "offload_param",
        "offload_optimizer",
        "precision",
        "gradient_clipping",
        "zero_stage",
        "step_in_backward",
        "allgather_bucket_size",
        "reduce_bucket_size",
        "prefetch_bucket_size",
        "reshard_after_forward",
    }
)


def _digest(value: Any) -> str:
    """A short digest of ``repr(value)`` that is the same in every process (``hash`` of a str
    is salted per process)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]
