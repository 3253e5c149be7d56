"""Shards and the registry that owns their state.

A shard is a contiguous range of one parameter's flattened elements: the whole parameter when it
fits in one swap buffer, else ``ceil(bytes / buffer_size)`` pieces, so a parameter larger than a
buffer streams through the buffers in pieces instead of failing. Shards are keyed by a stable id
(the parameter's qualified name, plus ``#k`` for piece k), which is what a checkpoint or a later
distributed partition will use to find them again.

All state lives here, in the registry, never as attributes on ``nn.Parameter``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from infinity.core.residency import Residency, check_transition

if TYPE_CHECKING:
    from infinity.core.timeline import Transfer
    from infinity.inference.quantized import WeightQuantizer
    from infinity.ranks.partition import Partition
    from swap import Extent

log = logging.getLogger(__name__)


class ShardKind(Enum):
    """What a shard's bytes are."""

    #: a range of a parameter's master values
    PARAM = "param"
    #: a param shard's accumulated gradient, kept beside it (a companion)
    GRAD = "grad"
    #: one of a param shard's optimizer state tensors, kept beside it (a companion)
    OPTIM = "optim"
    #: a param shard's values in a smaller dtype, which gathers read instead of the master
    #: (precision.storage_dtype with an optimizer), kept beside it (a companion)
    COMPUTE = "compute"


#: the key of a param shard's gradient companion in ``Shard.companions``
GRAD_KEY = "grad"
#: the key of a param shard's compute copy in ``Shard.companions``
COMPUTE_KEY = "compute"
#: the prefix of an optimizer-state companion's key in ``Shard.companions`` (then the state key)
OPTIM_PREFIX = "optim:"


@dataclass(eq=False)
class Shard:
    """Bytes with one residency: a range of a parameter's master values, or, for a param shard,
    a companion (its accumulated gradient, or one of its optimizer state tensors) when those
    live in the arena and on NVMe."""

    id: str
    entry: ParamEntry
    start: int  # first element within the flattened parameter
    numel: int
    dtype: torch.dtype
    kind: ShardKind = ShardKind.PARAM
    #: a companion's key in its param shard's ``companions`` (``GRAD_KEY``, ``COMPUTE_KEY``,
    #: or ``"optim:<state key>"``); None for a param shard
    companion_key: str | None = None
    #: an optimizer-state companion kept in fewer bytes than the state it holds: the codec's
    #: name (``precision.optimizer_state_dtype``; infinity.training.state_codecs); None: the
    #: values as they are
    encoding: str | None = None
    #: a param shard stored quantized (precision.storage_dtype int8/int4, inference): how its
    #: ``numel`` elements are kept in ``nbytes`` bytes (``dtype`` is then uint8); None: as
    #: ``numel`` elements of ``dtype``
    quant: WeightQuantizer | None = None
    #: a companion's param shard (the master it belongs to); None for a param shard
    owner: Shard | None = None
    state: Residency = Residency.EMPTY
    #: the host copy (a view into the staging arena, or a standalone host tensor)
    host: torch.Tensor | None = None
    #: byte offset of ``host`` inside the arena, when it lives there
    arena_offset: int | None = None
    #: the NVMe home
    extent: Extent | None = None
    #: an NVMe transfer in flight, and its timeline record when recording
    pending: Future[int] | None = None
    io_record: Transfer | None = None
    #: accumulated gradient in host memory, when gradients are not swapped (else companion)
    grad: torch.Tensor | None = None
    #: squared L2 norm of the accumulated gradient (kept so clipping needs no extra pass);
    #: None when it was not computed (nothing asked for norms yet)
    grad_sq_norm: float | None = None
    #: a factor the user's loop applied to the gradient (``p.grad.mul_(c)``, as clipping
    #: does), recorded instead of done and applied where the step reads the gradient
    grad_scale: float = 1.0
    #: a param shard's companions, by key (see ``companion_key``)
    companions: dict[str, Shard] = field(default_factory=dict)
    #: the host parameter the wrapped optimizer updates
    step_param: torch.nn.Parameter | None = None
    #: CUDA event marking the end of the last copy out of ``host`` (the slot is busy until then)
    copy_event: torch.cuda.Event | None = None
    version: int = 0
    #: partitioned across ranks (infinity.ranks.partition): (start, numel) of the whole piece that
    #: every rank's slice makes up; ``start``/``numel`` are then this rank's slice, padded so
    #: that all slices are equally long, of which the first ``real`` elements are parameter
    #: elements and the rest padding (zeros)
    piece: tuple[int, int] | None = None
    real: int | None = None

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            return self.quant.stored_bytes(self.numel)
        return self.numel * self.dtype.itemsize

    @property
    def host_numel(self) -> int:
        """Elements (of ``dtype``) of the host copy: ``numel``, or the stored bytes of a
        quantized shard."""
        return self.numel if self.quant is None else self.nbytes

    def values_into(self, out: torch.Tensor, stored: torch.Tensor | None = None) -> None:
        """Writes the values of ``stored`` (default the host copy) into ``out`` (``numel``
        elements, flat): a copy, or a quantized shard decoded."""
        source = self.host_copy() if stored is None else stored
        if self.quant is None:
            out.copy_(source)
        else:
            self.quant.decode(source, out)

    def host_copy(self) -> torch.Tensor:
        """The host copy, which the caller has made sure is there (``ensure_host``, a slot
        just filled)."""
        assert self.host is not None, f"{self} has no host copy"
        return self.host

    @property
    def real_numel(self) -> int:
        """Elements of the parameter this shard holds (its length less any padding)."""
        return self.numel if self.real is None else self.real

    def part_of(self, flat: torch.Tensor) -> torch.Tensor:
        """The elements of the flattened parameter ``flat`` that this shard holds."""
        return flat[self.start : self.start + self.real_numel]

    def padded(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (``real_numel`` elements) as ``numel`` elements, the padding zero: the
        tensor itself when there is no padding, else a new one."""
        if values.numel() == self.numel:
            return values
        out = torch.zeros(self.numel, dtype=values.dtype, device=values.device)
        out[: values.numel()].copy_(values)
        return out

    def fill_from(self, values: torch.Tensor) -> None:
        """Sets the host copy to ``values`` (``real_numel`` elements, any dtype); padding is
        zero."""
        host = self.host
        assert host is not None, f"{self.id} has no host copy to fill"
        if self.quant is not None:
            self.quant.encode(values, host)  # never partitioned (one process)
            return
        if self.real is None or self.real == self.numel:
            host.copy_(values)
            return
        host[: self.real].copy_(values)
        host[self.real :].zero_()

    def __repr__(self) -> str:
        return f"Shard({self.id}, {self.numel} x {self.dtype}, {self.state.name})"


@dataclass(eq=False)
class ParamEntry:
    """One model parameter: its shards and its device copy."""

    name: str
    param: torch.nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    shards: list[Shard] = field(default_factory=list)
    #: dtype of the device working copy (the master dtype, or bf16/fp16 under mixed precision)
    compute_dtype: torch.dtype = torch.float32
    #: whether ``device_tensor`` (whose storage is empty otherwise) holds values
    resident: bool = False
    #: the device working copy: a plain tensor of the parameter's shape whose storage the
    #: parameter shares between uses (see Placement.drop_device)
    device_tensor: torch.Tensor | None = None
    #: bumped whenever the gradient is consumed or cleared: a gradient view taken before
    #: knows it is stale
    grad_generation: int = 0
    #: reasons the device copy must stay: active modules and pending backward uses
    holds: int = 0
    #: the parameter's dtype when attached: what it gets back at close
    given_dtype: torch.dtype | None = None
    #: set while the device copy is lent by the host copy (a CPU device in inference, see
    #: HostLending.lend): ``device_tensor`` is then a view of the host master, and this is the
    #: empty placeholder the parameter goes back to when the copy is dropped
    placeholder: torch.Tensor | None = None
    #: set while the device copy is a range of the device tier's reusable slab (a CPU device in
    #: inference, when the host copy cannot be lent: see HostLending.stage): its byte offset
    slab_offset: int | None = None

    @property
    def lent(self) -> bool:
        """Whether the device copy is the host copy itself (so the two go together)."""
        return self.placeholder is not None and self.slab_offset is None

    index: int = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def quantized(self) -> bool:
        """Whether the shards are stored quantized (``Shard.quant``)."""
        return bool(self.shards) and self.shards[0].quant is not None

    @property
    def values_dtype(self) -> torch.dtype:
        """The dtype values written into the parameter are taken in: its master dtype, or for
        a quantized weight the dtype it was given in (it is encoded from that)."""
        if self.quantized:
            return self.given_dtype or self.compute_dtype
        return self.dtype

    @property
    def nbytes(self) -> int:
        if self.quantized:
            return sum(s.nbytes for s in self.shards)
        return self.numel * self.dtype.itemsize

    @property
    def device_bytes(self) -> int:
        return self.numel * self.compute_dtype.itemsize

    def __repr__(self) -> str:
        # never the tensors: between uses ``device_tensor`` (and the parameter, inside the
        # store) has its real shape over an empty storage, and printing it reads freed memory
        where = "resident" if self.resident else "not resident"
        return (
            f"ParamEntry({self.index}: {self.name}, {tuple(self.shape)} x {self.dtype}, "
            f"{where}, holds={self.holds})"
        )


class ShardRegistry:
    """Owns every shard and parameter entry; the one place residency changes happen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.shards: dict[str, Shard] = {}
        self.entries: list[ParamEntry] = []
        self._by_param: dict[int, ParamEntry] = {}
        #: ids of shards whose NVMe copy was written and has not been read since: a write
        #: earns its cost only if that copy is read back (after an eviction); one superseded
        #: (the host copy updated again) or discarded unread was not needed
        self._written_unread: set[str] = set()
        self.unread_writes = 0
        self.unread_write_bytes = 0
        #: shards (masters and companions) whose only copy is on NVMe: while none is, nothing
        #: is there to read ahead
        self.on_nvme = 0

    def add_param(
        self,
        name: str,
        param: torch.nn.Parameter,
        max_shard_bytes: int,
        compute_dtype: torch.dtype | None = None,
        partition: Partition | None = None,
        storage_dtype: torch.dtype | None = None,
        quant: WeightQuantizer | None = None,
        master_dtype: torch.dtype = torch.float32,
    ) -> ParamEntry:
        """Registers ``param``; with ``compute_dtype`` (mixed precision) its floating-point
        masters are ``master_dtype`` (fp32, or bf16 rounded stochastically by the updates) and
        the device copy is ``compute_dtype``; with ``storage_dtype``
        (inference) its floating-point values are kept in that dtype instead. With a
        ``partition`` (several data-parallel ranks) each shard is this rank's slice of its
        piece. With ``quant`` (inference, one process) its values are stored quantized, and
        each shard holds whole units of the quantizer."""
        master = param.dtype
        compute = param.dtype
        widened = False  # a master narrower than fp32 that the optimizer updates in fp32
        if compute_dtype is not None and param.is_floating_point():
            master, compute = master_dtype, compute_dtype
            widened = master_dtype.itemsize < 4
        if storage_dtype is not None and param.is_floating_point():
            master, widened = storage_dtype, False
        if quant is not None:
            master = torch.uint8
        entry = ParamEntry(
            name,
            param,
            param.shape,
            master,
            param.requires_grad,
            index=len(self.entries),
            compute_dtype=compute,
            given_dtype=param.dtype,
        )
        itemsize = master.itemsize
        if widened:
            # bf16 masters are updated in fp32: their optimizer state (fp32 to the update, kept
            # so with optimizer_state_dtype='fp32') must fit a buffer as well
            itemsize = 4
        per_shard = max(1, max_shard_bytes // itemsize)
        if quant is not None:
            unit_bytes = quant.stored_bytes(quant.unit)
            per_shard = max(1, max_shard_bytes // unit_bytes) * quant.unit
        if partition is not None:
            per_shard *= partition.world  # each rank's slice of a piece fills at most a buffer
        numel = param.numel()
        count = max(1, -(-numel // per_shard))
        for k in range(count):
            start = k * per_shard
            shard_id = name if count == 1 else f"{name}#{k}"
            length = min(per_shard, numel - start)
            if partition is None:
                shard = Shard(shard_id, entry, start, length, master, quant=quant)
            else:
                first, per_rank, real = partition.slice_of(start, length)
                shard = Shard(
                    shard_id, entry, first, per_rank, master, piece=(start, length), real=real
                )
            entry.shards.append(shard)
            self.shards[shard_id] = shard
        self.entries.append(entry)
        self._by_param[id(param)] = entry
        return entry

    def rebind(self, entry: ParamEntry, param: torch.nn.Parameter) -> None:
        """Points ``entry`` at a new Parameter object (a meta parameter materialised); the old
        object still finds the entry, so an optimizer built over it can be wrapped."""
        entry.param = param
        self._by_param[id(param)] = entry

    def entry_of(self, param: torch.Tensor) -> ParamEntry | None:
        return self._by_param.get(id(param))

    def set_state(self, shard: Shard, new: Residency) -> None:
        with self.lock:
            check_transition(shard.id, shard.state, new)
            old, shard.state = shard.state, new
            self.on_nvme += (new is Residency.NVME) - (old is Residency.NVME)
            if old is Residency.HOST_STORING and new is Residency.HOST_NVME:
                self._written_unread.add(shard.id)
            elif shard.id in self._written_unread:
                if old is Residency.NVME_LOADING and new is Residency.HOST_NVME:
                    self._written_unread.discard(shard.id)  # read back: the write was needed
                elif new in (Residency.HOST, Residency.EMPTY):
                    self._written_unread.discard(shard.id)
                    self.unread_writes += 1
                    self.unread_write_bytes += shard.nbytes

    def snapshot(self) -> dict[str, dict]:
        """A JSON-able description of every shard (for checkpoints and debugging)."""
        with self.lock:
            return {
                s.id: {
                    "param": s.entry.name,
                    "start": s.start,
                    "numel": s.numel,
                    "dtype": str(s.dtype).removeprefix("torch."),
                    "state": s.state.name,
                    "version": s.version,
                }
                for s in self.shards.values()
            }


def state_companions(shard: Shard) -> dict[str, Shard]:
    """The shard's optimizer-state companions that hold values, by state key."""
    return {
        kind[len(OPTIM_PREFIX) :]: companion
        for kind, companion in shard.companions.items()
        if kind.startswith(OPTIM_PREFIX) and companion.state is not Residency.EMPTY
    }
