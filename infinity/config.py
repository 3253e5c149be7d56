"""The runtime's public configuration: frozen, strictly validated dataclasses.

Three ways in, one result:

* ``OffloadConfig(...)`` / ``.replace(...)`` in Python (values must already have the right type),
* ``OffloadConfig.from_dict`` / ``from_file`` for the native JSON format (keys are field names,
  ``aio``/``precision``/``batch`` are nested objects, byte sizes may be strings like ``"2GiB"``),
* ``OffloadConfig.from_deepspeed`` for an existing DeepSpeed config (see ``deepspeed_config``).

Every invalid value raises :class:`~infinity.errors.ConfigError` naming the field, the value, what
is allowed and what to do; unknown keys name the closest valid key. Nothing here touches the disk
or the GPU: whether ``nvme_path`` exists or ``cuda:3`` is present is checked when the store
attaches, so a config can be built and inspected on any machine.

Size strings: ``B``; ``K``/``KiB``, ``M``/``MiB``, ``G``/``GiB``, ``T``/``TiB`` are powers of 1024;
``KB``, ``MB``, ``GB``, ``TB`` are powers of 1000 (as in Hugging Face's ``max_shard_size``).
Fractions are allowed when the result is a whole number of bytes (``"1.5G"``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from infinity.config_rules import (
    Rule,
    Validated,
    bad_value,
    check_keys,
    field_rule,
    format_size,
    load_json,
    parse_size,
)
from infinity.errors import ConfigError
from swap import EngineSettings

log = logging.getLogger("infinity.config")

ALIGNMENT = 4096  # O_DIRECT granularity; matches swap.buffers.ALIGNMENT

BACKENDS = ("auto", "uring", "threads", "buffered")
DTYPES = ("fp32", "bf16", "fp16")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: precision.optimizer_state_dtype: how per-element optimizer state is stored between steps
STATE_DTYPES = ("fp32", "bf16", "int8")
#: precision.master_dtype: the dtype the optimizer's masters are kept in between updates
MASTER_DTYPES = ("fp32", "bf16")
#: precision.storage_dtype: the dtypes above, or weights quantized for inference
STORAGE_DTYPES = ("auto",) + DTYPES + ("int8", "int4")


# --------------------------------------------------------------------------- the dataclasses


@dataclass(frozen=True)
class AioConfig(Validated):
    """How swap I/O is issued to the drives (same names as ``swap.engine.EngineSettings``).

    backend: ``auto`` probes each swap directory once and uses ``uring`` (io_uring + O_DIRECT)
        when the kernel and file system allow it, else ``threads`` (worker threads + O_DIRECT),
        else ``buffered`` (worker threads through the page cache). Memory: none of its own, but
        ``buffered`` also fills the kernel page cache with swap data.
    block_size: bytes per I/O request; transfers are cut into requests of at most this size.
        Multiple of 4096 (O_DIRECT), >= 4096. Larger blocks mean fewer syscalls; 1 MiB saturates
        most NVMe drives. Memory: none extra (requests are slices of the swap buffers).
    queue_depth: requests kept in flight per drive, 1..1024. Deeper queues help NVMe reach full
        bandwidth. Memory: negligible (one submission slot per request).
    thread_count: worker threads of the ``threads``/``buffered`` backends; None = queue_depth.
        Ignored by ``uring``. Memory: one thread stack each (mostly virtual).
    request_timeout: seconds a single request may stay in flight before its transfer fails
        with ``TransferTimeoutError`` naming the file and offset (a hung or failing drive);
        None waits forever. Raise it for slow network or throttled disks. Memory: none.
    """

    _section: ClassVar[str] = "aio"

    backend: str = field(default="auto", metadata=field_rule(kind="choice", choices=BACKENDS))
    block_size: int = field(
        default=1 << 20,
        metadata=field_rule(
            kind="int",
            lo=ALIGNMENT,
            size=True,
            fix="use a multiple of 4096 such as '1MiB' (note MB means 10**6 bytes)",
        ),
    )
    queue_depth: int = field(default=8, metadata=field_rule(kind="int", lo=1, hi=1024))
    thread_count: int | None = field(
        default=None,
        metadata=field_rule(
            kind="int", lo=1, hi=1024, optional=True, fix="use null to follow queue_depth"
        ),
    )
    request_timeout: float | None = field(
        default=60.0,
        metadata=field_rule(
            kind="float",
            lo=0.001,
            optional=True,
            fix="use a number of seconds such as 60, or null to wait forever",
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size % ALIGNMENT:
            raise bad_value(
                "aio.block_size",
                self.block_size,
                f"a multiple of {ALIGNMENT}",
                "use a power of two such as 1048576 ('1MiB'); MB means 10**6 bytes",
            )

    def engine_settings(self, **fields: Any) -> EngineSettings:
        """The swap engine settings this section gives, with ``fields`` (``file_size``,
        ``verify_checksums``, ...) that the engine's user decides."""
        return EngineSettings(
            backend=self.backend,
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            thread_count=self.thread_count,
            request_timeout=self.request_timeout,
            **fields,
        )


@dataclass(frozen=True)
class PrecisionConfig(Validated):
    """Numeric format of the working parameters and, for fp16, the loss scaler.

    dtype: compute dtype of the working params: ``fp32``, ``bf16`` or ``fp16``. Memory: 4 bytes
        per parameter for fp32, 2 for bf16/fp16 wherever the working params live (device,
        host cache, swap files); mixed precision adds a 4-byte fp32 master copy per parameter
        held with the optimizer state.
    loss_scale: fp16 only. 0 = dynamic loss scaling, > 0 = this static scale. No memory cost.
    initial_scale_power: dynamic scaling starts at 2**initial_scale_power (0..63). No memory
        cost.
    loss_scale_window: overflow-free steps before the dynamic scale is doubled (>= 1). No
        memory cost.
    hysteresis: overflows tolerated before the dynamic scale is halved (>= 1). No memory cost.
    min_loss_scale: floor of the dynamic scale (> 0). No memory cost.
    storage_dtype: dtype offloaded parameters are read in between uses (host cache, swap
        files), converted to the compute dtype on their way to the device: ``auto`` (the
        masters': the model's, fp32 under mixed precision) or ``fp32``/``bf16``/``fp16``. In
        inference (a store attached without an optimizer) the weights are kept in that dtype
        only: ``bf16`` halves the bytes each forward reads from NVMe, at bf16's precision of
        the weights. In training (with an optimizer; ``offload_param='nvme'`` and
        ``precision.dtype`` the same dtype) the fp32 masters stay for the updates and a compute
        copy of each in that dtype is kept beside it on NVMe, which forward and backward read
        instead of the master (half the bytes), and which the step writes as it updates the
        master; training is bit for bit that of ``precision.dtype`` alone. Memory: 2
        bytes/param for bf16/fp16 wherever the params live between uses; in training 2
        bytes/param more on disk, and written per step. ``int8`` and ``int4`` (inference only:
        a store attached without an optimizer, ``offload_param`` 'cpu' or 'nvme', one process)
        store each float weight of 2+ dimensions and 1024+ elements quantized, once, and
        decode it into the compute dtype on its way to the device; norms, biases and small
        tensors stay in their dtype. ``int8``: symmetric, a scale per output channel (row), 1
        byte/param. ``int4``: asymmetric, a scale and a minimum per group of
        ``quant_group_size`` elements along the input dimension, about 0.56 bytes/param at
        128 (see ``infinity.inference.quantized``). The model then computes with the rounded
        weights.
    quant_group_size: elements per int4 group (an even number >= 2 that divides every
        quantized weight's input dimension; default 128). Smaller groups round closer and
        store more scales. Memory: 8 bytes of scales per group, wherever the weights live.
    optimizer_state_dtype: how per-element optimizer state (Adam's two moments) is stored
        between steps: ``fp32`` (default: as the optimizer keeps it, bit-exact against plain
        PyTorch), ``bf16`` (rounded stochastically) or ``int8`` (blockwise: an 8-bit code per
        element on a logarithmic scale and an fp32 scale per block of 2048, as 8-bit Adam
        keeps it); the optimizer still updates in fp32, converting on the way in and out (see
        ``infinity.training.state_codecs``). Needs ``offload_optimizer='nvme'``. Disk and
        traffic: 8 bytes/param of Adam state read and written per step become 4 (bf16) or
        about 2 (int8); the training curve moves within noise for bf16 and slightly for int8.
    master_dtype: the dtype the masters (what the optimizer updates) are kept in under mixed
        precision: ``fp32`` (default) or ``bf16`` (needs ``dtype='bf16'``): each update
        computes in fp32 and rounds back to bf16 stochastically, so that an update below
        bf16's resolution still moves the weight in expectation; the noise comes from the
        shard and the step count, never the global random streams (runs and resumed runs
        repeat exactly). Forward and backward compute with the master itself (no compute copy);
        gradients are bf16; optimizer state is fp32 to the update (stored in
        ``optimizer_state_dtype``). Memory: masters 2 bytes/param instead of 4 and no 2-byte
        compute copy: with int8 state about 4 bytes per trained parameter instead of 8.
        Cost: the curve moves slightly (``make bench-masters`` measures it).
    """

    _section: ClassVar[str] = "precision"

    dtype: str = field(default="fp32", metadata=field_rule(kind="choice", choices=DTYPES))
    loss_scale: float = field(
        default=0.0,
        metadata=field_rule(
            kind="float", lo=0, fix="use 0 for dynamic loss scaling or a positive static scale"
        ),
    )
    initial_scale_power: int = field(default=16, metadata=field_rule(kind="int", lo=0, hi=63))
    loss_scale_window: int = field(default=1000, metadata=field_rule(kind="int", lo=1))
    hysteresis: int = field(default=2, metadata=field_rule(kind="int", lo=1))
    min_loss_scale: float = field(
        default=1.0, metadata=field_rule(kind="float", lo=0, fix="use a positive scale such as 1")
    )
    storage_dtype: str = field(
        default="auto", metadata=field_rule(kind="choice", choices=STORAGE_DTYPES)
    )
    quant_group_size: int = field(
        default=128,
        metadata=field_rule(kind="int", lo=2, fix="use an even group size such as 128 or 64"),
    )
    optimizer_state_dtype: str = field(
        default="fp32", metadata=field_rule(kind="choice", choices=STATE_DTYPES)
    )
    master_dtype: str = field(
        default="fp32", metadata=field_rule(kind="choice", choices=MASTER_DTYPES)
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.master_dtype == "bf16" and self.dtype != "bf16":
            raise bad_value(
                "precision.master_dtype",
                self.master_dtype,
                "'fp32' unless precision.dtype is 'bf16' (bf16 masters are what the model "
                "computes with)",
                "set precision.dtype='bf16', or leave master_dtype at 'fp32'",
            )
        if self.master_dtype == "bf16" and self.storage_dtype not in ("auto", "bf16"):
            raise bad_value(
                "precision.storage_dtype",
                self.storage_dtype,
                "'auto' or 'bf16' with master_dtype='bf16' (the masters are stored in bf16)",
                "leave storage_dtype at 'auto'",
            )
        if self.quant_group_size % 2:
            raise bad_value(
                "precision.quant_group_size",
                self.quant_group_size,
                "an even number (two int4 codes share a byte)",
                f"use {self.quant_group_size + 1} or another even group size such as 128",
            )
        if self.min_loss_scale == 0:
            raise bad_value(
                "precision.min_loss_scale",
                self.min_loss_scale,
                "a number > 0",
                "use a positive scale such as 1",
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element of the working params."""
        return DTYPE_BYTES[self.dtype]

    @property
    def widened_masters(self) -> bool:
        """bf16 masters, updated in fp32 (fp32 state, no compute copy): see master_dtype."""
        return self.master_dtype != "fp32"


@dataclass(frozen=True)
class BatchConfig(Validated):
    """Batch sizes, informational for trainers and tools (DeepSpeed's batch keys).

    train_batch_size: samples per optimizer step over all processes (None = unspecified). No
        memory cost.
    micro_batch_size: samples per forward/backward (None = unspecified). Memory: activation
        memory grows with it, but this config does not manage activations.
    gradient_accumulation_steps: micro batches per optimizer step (>= 1). No memory cost.
    When all three are given, train_batch_size must be a multiple of micro_batch_size x
    gradient_accumulation_steps (the quotient is the number of data-parallel processes).
    """

    _section: ClassVar[str] = "batch"

    train_batch_size: int | None = field(
        default=None, metadata=field_rule(kind="int", lo=1, optional=True)
    )
    micro_batch_size: int | None = field(
        default=None, metadata=field_rule(kind="int", lo=1, optional=True)
    )
    gradient_accumulation_steps: int = field(default=1, metadata=field_rule(kind="int", lo=1))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train_batch_size is not None and self.micro_batch_size is not None:
            step = self.micro_batch_size * self.gradient_accumulation_steps
            if self.train_batch_size % step:
                raise bad_value(
                    "batch.train_batch_size",
                    self.train_batch_size,
                    f"a multiple of micro_batch_size x gradient_accumulation_steps = {step}",
                    "fix one of the three batch settings or leave one unset",
                )


_SIZE_FIX = "use a byte count such as 1073741824 or, in JSON, '1GiB'"

#: the swap buffer size without a host budget, and the largest one derived from a budget
DEFAULT_BUFFER_SIZE = 64 << 20
#: the smallest buffer size derived from a host budget (a request per MiB keeps a drive busy)
MIN_DERIVED_BUFFER_SIZE = 1 << 20


def derived_buffer_size(host_budget: int | None) -> int:
    """``buffer_size=None``: 64 MiB; under a host budget a 64th of it rounded down to a power
    of two within 1-64 MiB (and at most an eighth of it), so that the arena holds several
    updates' parts however small the budget."""
    if host_budget is None:
        return DEFAULT_BUFFER_SIZE
    size = 1 << (max(host_budget // 64, 1).bit_length() - 1)
    size = min(DEFAULT_BUFFER_SIZE, max(MIN_DERIVED_BUFFER_SIZE, size))
    eighth = 1 << (max(host_budget // 8, 1).bit_length() - 1)
    return max(ALIGNMENT, min(size, eighth))


class ForeignFormat(Protocol):
    """Another tool's config format, read into an :class:`OffloadConfig`. The DeepSpeed one
    (:mod:`infinity.deepspeed_config`) builds its configs through this module, so this module
    does not import it: the package hands it over once (:func:`read_deepspeed_with`)."""

    #: top-level keys of the format: a file holding one this module does not know is read by it
    top_level_keys: frozenset[str]

    def read(self, source: Mapping[str, Any] | str | os.PathLike[str]) -> OffloadConfig:
        """The config ``source`` (a dict, or the path of its JSON file) describes."""
        ...


_deepspeed: ForeignFormat | None = None


def read_deepspeed_with(reader: ForeignFormat) -> None:
    """Sets the reader ``OffloadConfig.from_deepspeed`` and ``from_file`` use for DeepSpeed
    configs (``import infinity`` sets :mod:`infinity.deepspeed_config`'s)."""
    global _deepspeed
    _deepspeed = reader


def _deepspeed_format() -> ForeignFormat:
    if _deepspeed is None:  # every import of infinity.config runs the package's __init__ first
        raise ConfigError("no DeepSpeed config reader: import infinity first")
    return _deepspeed


@dataclass(frozen=True)
class OffloadConfig(Validated):
    """Everything the offload runtime needs to know; see the module docstring for the formats.

    device: where compute runs: ``auto`` (cuda if available else cpu), ``cpu``, ``cuda``,
        ``cuda:N``. Checked against the hardware at attach time. No memory cost.
    offload_param: where parameters live between uses: ``none`` (device; device memory holds
        the whole model), ``cpu`` (host RAM holds all params at dtype bytes/param), ``nvme``
        (swap files hold them; host RAM holds at most max_in_cpu bytes plus the swap buffers).
        Memory: 4 bytes/param in fp32 (2 in bf16/fp16) on the tier named.
    offload_optimizer: where optimizer state lives: ``none``, ``cpu`` or ``nvme``. ``none``
        and ``cpu`` both keep it in host RAM as the optimizer made it (outside host_budget:
        ``stats()['rss_bound']['optimizer_outside_host']``), updated on the host, except that
        with ``offload_param='none'`` and fp32 nothing is offloaded and ``none`` leaves the
        optimizer on the device. With ``offload_param='none'`` and this offloaded
        (ZeRO-Offload), every parameter stays on the device and its fp32 master moves with the
        optimizer state.
        Memory: Adam keeps about 12 bytes/param (fp32 master, momentum, variance) on that tier.
    offload_activations: where the tensors autograd saves in forward (activations) wait for
        backward: ``none`` (the device, as without the store), ``cpu`` (host RAM) or ``nvme``
        (swap files, written through the swap engine). Each module's saved tensors leave the
        device after its forward and are read back ahead of its backward, newest first,
        ``prefetch_depth`` modules ahead; parameters and tensors under 64 KiB stay. With
        activation checkpointing only the checkpoints' inputs are saved, so only they move.
        Memory: the device holds a few modules' activations instead of all of them; ``cpu``
        holds every saved activation in host RAM (pinned with CUDA; within what an explicit
        host_budget leaves after the arena and CPU-held parameters), ``nvme`` 4 x 16 MiB of
        staging buffers and the activations' bytes on disk. Costs a copy out and back per
        saved byte (and the disk's write and read for ``nvme``).
    nvme_path: swap directories, one per drive (requests are striped over them); a str, Path
        or list of them. () = a private temporary directory made by the store. Disk: the
        offloaded params/state, plus preallocation slack.
    buffer_count: pinned swap buffers in the pool (>= 1; the store needs >= 2 to overlap I/O
        with compute, 1 works but serialises it and is logged). Memory: buffer_count x
        buffer_size bytes of host RAM (see buffer_size).
    buffer_size: bytes per swap buffer (>= 4096; the pool rounds up to 4096), which is also
        the largest shard a parameter is cut into; None (default): 64 MiB, or with a host_budget
        a 64th of it rounded down to a power of two within 1-64 MiB, so that a small budget
        still holds enough buffers to update in backward.
        Memory: buffer_count x buffer_size bytes of host RAM, page-locked when pin_memory is set
        (default 5 x 64 MiB = 320 MiB); under a host_budget the staging arena is whatever the
        budget leaves (see host_budget), never less than this.
    pin_memory: page-lock host buffers so device copies are asynchronous and faster. Pinned RAM
        cannot be swapped by the OS and counts against memlock/container limits. Memory: no
        more bytes, but the arena's are pinned.
    max_in_cpu: bytes of host RAM the staging arena may grow to as a cache in front of the
        drives, when larger than buffer_count x buffer_size (0, the default: the swap buffers
        are the cache). Memory: up to this much host RAM, never more than the offloaded state.
    device_budget: bytes of device memory the runtime may use for params, prefetch and
        buffers; None = derived by the store and reported: on CUDA half the free memory (at
        most every parameter), on a CPU device (which is host RAM) a working set of the next
        modules' parameters, twice over, next to the shared and persistent ones (under a
        host_budget at most a quarter of it, and part of it). An explicit device_budget on a
        CPU device is host RAM on top of host_budget. Memory: up to this much device memory.
    host_budget: bytes of host RAM the runtime may use; None = derived by the store and
        reported. With it set, the process's peak RSS stays within the process's own memory
        (interpreter, torch, the model's module objects, measured at attach) + host_budget +
        saved activations (unless offloaded) + what an explicit CPU device_budget or the
        buffers asked for add: ``stats()['rss_bound']``. It holds the staging arena (all of
        the budget the other parts leave: a cache in front of the drives), CPU-offloaded
        parameters, a CPU device's derived working copies, and a reserve for the store's
        transients (the largest parameter's gradient buffers, the first step's optimizer
        state, a checkpoint's write buffers); with offload_activations='cpu' the arena is the
        swap buffers and the rest is the activations'. Memory: up to this much host RAM.
    prefetch_depth: modules fetched ahead of the one computing (0 = no prefetch). Without
        autograd (inference) the whole arena is read ahead instead, into the next forward.
        Memory: the params of that many modules on the device and in flight.
    prefetch_bytes: cap on bytes being prefetched at once; None = bounded only by
        prefetch_depth and the budgets. Memory: none of its own (prefetches land in the arena
        and the device budget).
    param_persistence_threshold: params with <= this many elements never leave the device
        (biases, norms). Memory: their total size on the device, usually small.
    gradient_clipping: max global gradient norm; 0 = off. No memory cost.
    keep_swap_files: keep swap files after the store closes (for inspection). Disk: they stay.
    verify_checksums: xxh3 checksum every swapped chunk, with the identity of what it holds,
        and check both on read-back (about 3-4% of read time at disk speed, on I/O threads);
        catches flipped bytes, stale and swapped extents. Memory: a few bytes per chunk.
    fused_optimizer: run Adam/AdamW created with default options through torch's fused CPU
        kernel (about 5x the per-tensor loop); results differ from the loop at rounding level.
        False keeps the user's kernel exactly. No memory cost.
    step_in_backward: where the optimizer update of each parameter runs. True: inside the
        backward pass, as soon as its gradient is complete, instead of in ``optimizer.step()``
        (which then only finishes the step). Gradients are consumed on the spot, so the
        training state never holds all of them at once and the optimizer state's reads overlap
        the backward. It needs exactly one backward per ``optimizer.step()`` (no gradient
        accumulation: a second backward raises), no use of ``p.grad`` between backward and
        step (it is None then), the hyper-parameters in ``param_groups`` set before backward,
        and no gradient clipping or fp16 loss scaling (both need every gradient first).
        False: every update in ``optimizer.step()``. 'auto' (default): the first step runs
        with updates in ``optimizer.step()`` and is watched; from the second on updates run in
        backward if, between that step's backward and ``optimizer.step()``, the loop ran one
        backward, used no ``p.grad``, ran no forward, read, checkpoint or state dict and kept
        the hyper-parameters, and called ``zero_grad()`` before the next backward; the config
        must have no clipping, no fp16 and an arena large enough (see
        ``infinity.training.update_timing``). A loop that does one of those after the switch gets a
        warning and updates go back to ``optimizer.step()`` for good; a second backward is an
        error before that gradient is used. Across ranks an update runs once its gradient's
        reduction has landed (each rank updates its slices). Memory: saves up to the
        gradients' bytes (4 bytes/param in fp32) of host or NVMe traffic.
    zero_stage: what is partitioned across data-parallel ranks under torch.distributed (no
        effect in one process): 3 = parameters, gradients and optimizer state (each rank holds
        and swaps 1/N of everything; a module's parameters are all-gathered while it runs);
        2 = gradients and optimizer state, with every parameter whole on each rank's device
        (needs offload_param='none'); 1 = optimizer state (gradients all-reduced whole).
        Memory per rank: about 16/N bytes/param of training state at stage 3 (plus the
        gathered modules), 2-4 bytes/param more on the device at stages 1 and 2.
    overlap_comm: across ranks, let gradient reductions run while backward computes (up to
        reduce_bucket_size bytes of them under way) instead of completing each at once.
        Memory: within reduce_bucket_size's.
    reduce_bucket_size: across ranks, bytes of gradients (whole, before the reduce-scatter)
        reduced by one collective: gradients smaller than half of it wait in a bucket until
        its other gradients arrive; a larger one is reduced alone, from autograd's own
        tensor. With overlap_comm, also the bytes of reductions left under way.
        Memory: up to about twice this much host (or, with NCCL, device) memory for gradients
        being bucketed and in flight; a larger value means fewer collectives.
    allgather_bucket_size: across ranks, bytes (whole, after the all-gather) of parameters
        assembled by one all-gather: a parameter smaller than half of it travels with the
        other small ones (the next modules' biases and norms, in attach order; persistent
        ones with persistent ones), a larger one alone, straight into its device copy. At
        most a quarter of the device budget. Memory: a bucket's bytes of device memory
        (host memory without a GPU) while it is copied out, outside device_budget.
    prefetch_bucket_size: across ranks at ZeRO stage 3, bytes of all-gathers started ahead of
        the modules that need them, in the recorded order, while the current one computes
        (the next module's always, when it fits the device budget); 0 = only on demand.
        Decided from the trace, the same on every rank. Memory: within device_budget.
    reshard_after_forward: across ranks at ZeRO stage 3, whether a module's gathered
        parameters go after its forward (True: its backward all-gathers them again) or stay
        until its backward. 'auto' (default): the last modules of forward keep theirs, as many
        as the device budget holds beside room for the others (decided from the trace, the same
        on every rank); False: every module's, refused at attach when device_budget cannot hold
        every parameter. Memory: within device_budget.
    restore_params: what ``close()`` hands back to the model as ordinary tensors (a call may
        say otherwise: ``close(restore_params=...)``). 'auto' (default): every parameter when
        their bytes fit in host_budget (without one: in half the memory available), else none
        (a model larger than RAM cannot be handed back whole): they are left on the meta
        device, with a warning saying where their values are (the last checkpoint, the kept
        swap files, or nowhere). True: every parameter, refused before anything is torn down
        when they do not fit in host_budget. False: none, all left on the meta device.
        Memory: the parameters' bytes in their own dtype, as the arena is given back.
    checkpoint_staging: bytes of chunks an asynchronous checkpoint save keeps copied out of
        the tiers, waiting for its writer. Memory: up to this much host RAM, plus the chunks a
        step copies out before it changes them (one tile).
    aio, precision, batch: see AioConfig, PrecisionConfig, BatchConfig.
    """

    device: str = field(default="auto", metadata=field_rule(kind="device"))
    offload_param: str = field(
        default="nvme", metadata=field_rule(kind="choice", choices=OFFLOAD_TARGETS)
    )
    offload_optimizer: str = field(
        default="none", metadata=field_rule(kind="choice", choices=OFFLOAD_TARGETS)
    )
    offload_activations: str = field(
        default="none", metadata=field_rule(kind="choice", choices=OFFLOAD_TARGETS)
    )
    nvme_path: tuple[Path, ...] = field(default=(), metadata=field_rule(kind="paths"))
    buffer_count: int = field(
        default=5,
        metadata=field_rule(kind="int", lo=1, fix="use 2 or more so swap I/O overlaps compute"),
    )
    buffer_size: int | None = field(
        default=None,
        metadata=field_rule(
            kind="int",
            lo=ALIGNMENT,
            optional=True,
            size=True,
            fix="use at least 4096 bytes, e.g. '64MiB', or null to derive it",
        ),
    )
    pin_memory: bool = field(default=True, metadata=field_rule(kind="bool"))
    max_in_cpu: int = field(
        default=0,
        metadata=field_rule(
            kind="int", lo=0, size=True, fix="use 0 to keep no params cached in host RAM"
        ),
    )
    device_budget: int | None = field(
        default=None,
        metadata=field_rule(
            kind="int", lo=1, optional=True, size=True, fix="use null to let the store derive it"
        ),
    )
    host_budget: int | None = field(
        default=None,
        metadata=field_rule(
            kind="int", lo=1, optional=True, size=True, fix="use null to let the store derive it"
        ),
    )
    prefetch_depth: int = field(
        default=2, metadata=field_rule(kind="int", lo=0, fix="use 0 to disable prefetch")
    )
    prefetch_bytes: int | None = field(
        default=None,
        metadata=field_rule(
            kind="int", lo=0, optional=True, size=True, fix="use null for no byte cap"
        ),
    )
    param_persistence_threshold: int = field(default=0, metadata=field_rule(kind="int", lo=0))
    gradient_clipping: float = field(
        default=0.0, metadata=field_rule(kind="float", lo=0, fix="use 0 to disable clipping")
    )
    keep_swap_files: bool = field(default=False, metadata=field_rule(kind="bool"))
    verify_checksums: bool = field(default=True, metadata=field_rule(kind="bool"))
    fused_optimizer: bool = field(default=True, metadata=field_rule(kind="bool"))
    step_in_backward: bool | str = field(default="auto", metadata=field_rule(kind="bool_or_auto"))
    overlap_comm: bool = field(default=True, metadata=field_rule(kind="bool"))
    reduce_bucket_size: int = field(
        default=64 << 20,
        metadata=field_rule(
            kind="int",
            lo=1,
            size=True,
            fix="use a positive size, e.g. '64MiB' (overlap_comm=False completes each "
            "reduction at once)",
        ),
    )
    allgather_bucket_size: int = field(
        default=64 << 20,
        metadata=field_rule(kind="int", lo=1, size=True, fix="use a positive size, e.g. '64MiB'"),
    )
    prefetch_bucket_size: int = field(
        default=64 << 20,
        metadata=field_rule(
            kind="int", lo=0, size=True, fix="use 0 to start all-gathers only on demand"
        ),
    )
    reshard_after_forward: bool | str = field(
        default="auto", metadata=field_rule(kind="bool_or_auto")
    )
    restore_params: bool | str = field(default="auto", metadata=field_rule(kind="bool_or_auto"))
    checkpoint_staging: int = field(
        default=64 << 20,
        metadata=field_rule(
            kind="int", lo=ALIGNMENT, size=True, fix="use at least 4096 bytes, e.g. '64MiB'"
        ),
    )
    zero_stage: int = field(
        default=3,
        metadata=field_rule(
            kind="int",
            lo=1,
            hi=3,
            fix="use 3 (parameters, gradients and optimizer state "
            "partitioned), 2 (gradients and optimizer state) or 1 (optimizer state)",
        ),
    )
    aio: AioConfig = field(default_factory=AioConfig, metadata=field_rule(kind="section"))
    precision: PrecisionConfig = field(
        default_factory=PrecisionConfig, metadata=field_rule(kind="section")
    )
    batch: BatchConfig = field(default_factory=BatchConfig, metadata=field_rule(kind="section"))

    def __post_init__(self) -> None:
        super().__post_init__()
        state_dtype = self.precision.optimizer_state_dtype
        if state_dtype != "fp32" and self.offload_optimizer != "nvme":
            raise ConfigError(
                f"precision.optimizer_state_dtype={state_dtype!r} stores the optimizer state "
                f"in fewer bytes in its swap files, but offload_optimizer="
                f"{self.offload_optimizer!r} keeps it in memory as the optimizer made it: set "
                f"offload_optimizer='nvme', or optimizer_state_dtype='fp32'",
                field="precision.optimizer_state_dtype",
            )
        if self.step_in_backward is True:
            # Both need the norm (or finiteness) of every gradient before any update.
            if self.gradient_clipping:
                raise ConfigError(
                    f"step_in_backward=True cannot be combined with gradient_clipping="
                    f"{self.gradient_clipping:g}: clipping by the global norm needs every "
                    f"gradient before the first update; set gradient_clipping=0 or "
                    f"step_in_backward=False",
                    field="step_in_backward",
                )
            if self.precision.dtype == "fp16":
                raise ConfigError(
                    "step_in_backward=True cannot be combined with precision.dtype='fp16': the "
                    "loss scaler must see every gradient before it can skip an overflowed "
                    "step; use bf16 or fp32, or step_in_backward=False",
                    field="step_in_backward",
                )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadConfig:
        """The native format: keys are field names, nested objects for aio/precision/batch."""
        return _build(cls, data, "the infinity config")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> OffloadConfig:
        """Load a JSON file, native or DeepSpeed (recognised by DeepSpeed-only top-level keys)."""
        data = load_json(path)
        deepspeed = _deepspeed_format()
        # "aio" and "gradient_clipping" exist in both formats, so they decide nothing.
        if not any(k in deepspeed.top_level_keys and k not in _FIELD_NAMES for k in data):
            return cls.from_dict(data)
        log.debug("%s holds a DeepSpeed config", path)
        return deepspeed.read(data)

    @classmethod
    def from_deepspeed(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> OffloadConfig:
        """Map a DeepSpeed config (dict, or path to its JSON); see ``infinity.deepspeed_config``."""
        return _deepspeed_format().read(source)

    def replace(self, **changes: Any) -> OffloadConfig:
        """A validated copy with ``changes``; sections may be given as dicts of changes to merge."""
        check_keys(changes, _FIELD_NAMES, "replace()")
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in changes.items():
            current = kwargs[key]
            if is_dataclass(current) and isinstance(value, Mapping):
                value = _build(type(current), {**_as_dict(current), **value}, key)
            elif _FIELDS[key].metadata["rule"].size and isinstance(value, str):
                value = parse_size(value, name=key)
            kwargs[key] = value
        return OffloadConfig(**kwargs)

    # ------------------------------------------------------------------ output

    def to_dict(self) -> dict[str, Any]:
        """The native format, JSON-serialisable (paths as strings); from_dict inverts it."""
        return _as_dict(self)

    def swap_buffer_size(self) -> int:
        """Bytes per swap buffer: ``buffer_size`` (rounded up to 4096), or the size derived
        from the host budget (see ``buffer_size``)."""
        if self.buffer_size is not None:
            return -(-self.buffer_size // ALIGNMENT) * ALIGNMENT
        return derived_buffer_size(self.host_budget)

    def swap_buffer_bytes(self) -> int:
        """Host RAM taken by the swap buffer pool (page-locked when pin_memory)."""
        return self.buffer_count * self.swap_buffer_size()

    def describe(self) -> str:
        """A short multi-line summary for logs and demos."""
        p, a = self.precision, self.aio
        where = ", ".join(str(x) for x in self.nvme_path) or "a private temporary directory"
        uses_nvme = "nvme" in (self.offload_param, self.offload_optimizer, self.offload_activations)
        if p.dtype == "fp16":
            scale = (
                f"static loss scale {p.loss_scale:g}"
                if p.loss_scale
                else f"dynamic loss scale from 2**{p.initial_scale_power}, window "
                f"{p.loss_scale_window}, hysteresis {p.hysteresis}, "
                f"min {p.min_loss_scale:g}"
            )
            precision = f"fp16 ({scale})"
        else:
            precision = p.dtype
        threads = (
            f", {a.thread_count or a.queue_depth} threads"
            if a.backend in ("threads", "buffered")
            else ""
        )
        offloading = (self.offload_param, self.offload_optimizer) != ("none", "none")
        lines = [
            "infinity offload config",
            f"  device            {self.device}",
            f"  parameters        {self._tier(self.offload_param)}"
            + (
                f", host cache up to {format_size(self.max_in_cpu)}"
                if self.offload_param == "nvme" and self.max_in_cpu
                else ""
            ),
            f"  optimizer state   {self._tier(self.offload_optimizer)}",
        ]
        if offloading:
            lines.append(
                f"  swap buffers      {self.buffer_count} x "
                f"{format_size(self.swap_buffer_size())} = "
                f"{format_size(self.swap_buffer_bytes())} host RAM"
                f"{' (pinned)' if self.pin_memory else ''}"
            )
        if uses_nvme:
            lines.append(f"  nvme_path         {where}")
            lines.append(
                f"  aio               {a.backend}, {format_size(a.block_size)} requests, "
                f"queue depth {a.queue_depth}{threads}"
            )
        lines += [
            f"  budgets           device {format_size(self.device_budget)}, "
            f"host {format_size(self.host_budget)}",
            f"  prefetch          {self.prefetch_depth} module(s) ahead"
            + (
                f", at most {format_size(self.prefetch_bytes)}"
                if self.prefetch_bytes is not None
                else ""
            ),
            f"  precision         {precision}",
        ]
        if self.gradient_clipping:
            lines.append(f"  gradient clipping {self.gradient_clipping:g}")
        if self.offload_activations != "none":
            lines.append(f"  activations       {self._tier(self.offload_activations)}")
        if self.step_in_backward is True:
            lines.append("  optimizer update  in backward, as each gradient completes")
        elif self.step_in_backward == "auto":
            lines.append(
                "  optimizer update  in backward from the second step, if the first "
                "shows the loop allows it"
            )
        if self.param_persistence_threshold:
            lines.append(f"  persistent params <= {self.param_persistence_threshold} elements")
        return "\n".join(lines)

    @staticmethod
    def _tier(target: str) -> str:
        return {"none": "on the device", "cpu": "cpu (host RAM)", "nvme": "nvme"}[target]


_FIELDS = {f.name: f for f in fields(OffloadConfig)}
_FIELD_NAMES = tuple(_FIELDS)


def _build(cls: type, data: Any, where: str) -> Any:
    """``cls`` from a dict, strict about keys, converting size strings and nested sections."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where} must be a JSON object ({{...}}), got {type(data).__name__} {data!r}",
            field=None if where.startswith("the ") else where,
        )
    known = {f.name: f for f in fields(cls)}
    check_keys(data, known, where)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        f = known[key]
        rule: Rule = f.metadata["rule"]
        if rule.kind == "section":
            value = _build(f.default_factory, value, key)  # type: ignore[arg-type]
        elif rule.size and isinstance(value, (str, float)) and not isinstance(value, bool):
            section = getattr(cls, "_section", "")  # a Validated class's section name
            prefix = f"{section}." if section else ""
            value = parse_size(value, name=prefix + key)
        kwargs[key] = value
    return cls(**kwargs)


def _as_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            value = _as_dict(value)
        elif isinstance(value, tuple):
            value = [str(p) for p in value]
        out[f.name] = value
    return out
