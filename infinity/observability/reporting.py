"""What ``TieredStore.stats()`` reports: one dictionary, read from the tiers, the engine, the
placement's counters and the partition, without changing any of them (other threads may call
it while the training thread works)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infinity.core.memory import huge_pages_advised

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


@dataclass(frozen=True)
class MemoryFigures:
    """What the store samples of memory beyond its tiers (see ``TieredStore.stats``)."""

    #: bytes of NVMe extents held now, and their peak
    nvme_bytes: int
    nvme_peak: int
    #: the process's peak RSS as sampled
    rss_peak: int
    #: freed heap blocks are reused (a host budget left room for it; infinity.core.memory)
    heap_reuse: bool
    #: the bound on the process's peak RSS and its terms (TieredStore.rss_bound; None before
    #: attach)
    rss_bound: dict[str, int] | None = None


def store_stats(store: AttachedStore, memory: MemoryFigures) -> dict[str, Any]:
    """``store.stats()``: bytes per tier (current and peak), I/O totals and timings, steps."""
    placement = store.placement
    engine = store.engine  # read once: close() may clear it from the training thread
    engine_stats = engine.stats() if engine is not None else None
    device = placement.device.usage if placement else None
    host = placement.host.usage if placement else None
    return {
        "current_bytes": {
            "device": device.current if device else 0,
            "host": host.current if host else 0,
            "nvme": memory.nvme_bytes,
        },
        "peak_bytes": {
            "device": device.peak if device else 0,
            "host": host.peak if host else 0,
            "nvme": memory.nvme_peak,
        },
        "budgets": dict(store.budgets),
        "bytes_read": engine_stats.bytes_read if engine_stats else 0,
        "bytes_written": engine_stats.bytes_written if engine_stats else 0,
        # writes whose NVMe copy was never read: superseded by a newer update of the host copy,
        # or discarded, before any read needed it (cost without use)
        "unread_writes": store.registry.unread_writes,
        "unread_write_bytes": store.registry.unread_write_bytes,
        # the drives busy: a transfer of either direction in flight
        "disk_busy_seconds": engine_stats.busy_seconds if engine_stats else 0.0,
        "io_seconds": (engine_stats.read_seconds + engine_stats.write_seconds)
        if engine_stats
        else 0.0,
        "read_seconds": engine_stats.read_seconds if engine_stats else 0.0,
        "write_seconds": engine_stats.write_seconds if engine_stats else 0.0,
        "stall_seconds": placement.completions.stall_seconds if placement else 0.0,
        # traffic between the device and host tiers (a quantized weight's stored bytes, which
        # are decoded on the way); the seconds are the training thread's own synchronous
        # copies (all of them without a GPU: the share of a step that a GPU's copy engine
        # would take off the cores)
        "bytes_to_device": placement.device.bytes_in if placement else 0,
        "bytes_from_device": placement.device.bytes_out if placement else 0,
        "device_copy_seconds": placement.device.copy_seconds if placement else 0.0,
        # device copies that are the host copy itself (a CPU device, no autograd): no copy
        "lent_gathers": placement.lending.lent_gathers if placement else 0,
        # ... and their bytes: with bytes_to_device, what gathers made device copies of
        "lent_bytes": placement.lending.lent_bytes if placement else 0,
        # a CPU device's gathers that found no free range in its slab (fresh memory instead)
        "device_slab_misses": placement.device.slab_misses if placement else 0,
        "steps": store.stepping.steps,
        # where optimizer updates run now (step_in_backward; 'auto' settles after one step)
        "update_mode": store.update_timing.mode.value if store.update_timing else None,
        # why updates run in optimizer.step(), each with the way to lift it ([] in backward)
        "update_mode_reasons": list(store.update_timing.reasons) if store.update_timing else [],
        "prefetched_loads": placement.prefetched_loads if placement else 0,
        "demand_loads": placement.demand_loads if placement else 0,
        "step_read_ahead_loads": placement.read_ahead_loads if placement else 0,
        # write-backs eviction had to start (and wait for) during forward and backward,
        # and those started ahead, during forward, from what the last pass had to wait for
        "forced_pass_writes": placement.room.forced_pass_writes if placement else 0,
        "write_ahead_writes": placement.prefetching.writes_ahead if placement else 0,
        "grad_bytes": placement.gradients.grad_bytes if placement else 0,
        "pinned_bytes": placement.host.pinned_bytes if placement else 0,
        "rss_peak_bytes": memory.rss_peak,
        # the bound on the process's peak RSS and its terms, beside that peak (None before
        # attach; infinity.core.budgets)
        "rss_bound": memory.rss_bound,
        # freed heap blocks reused (a host budget left room for it; infinity.core.memory)
        "heap_reuse": memory.heap_reuse,
        # torch's large CPU blocks fault 2 MiB pages (THP_MEM_ALLOC_ENABLE; infinity.core.memory)
        "huge_page_allocations": bool(huge_pages_advised()),
        "trace_departures": store.follower.diverged_iterations,
        "backend": engine.backend_name if engine is not None else None,
        # failed transfers: each failed attempt, re-issues, transfers that succeeded after
        # failing, and failures that outlasted the retries (see infinity.core.placement)
        "io_errors": placement.completions.io_errors if placement else 0,
        "io_retries": placement.completions.io_retries if placement else 0,
        "io_recoveries": placement.completions.io_recoveries if placement else 0,
        "io_failures": placement.completions.io_failures if placement else 0,
        "io_timeouts": engine_stats.timeouts if engine_stats else 0,
        "integrity_errors": engine_stats.integrity_errors if engine_stats else 0,
        # arena bytes held back because a timed-out read may still write into them
        "quarantined_bytes": placement.completions.quarantined_bytes if placement else 0,
        # across data-parallel ranks (None in one process): bytes this rank sent into
        # all-gathers (its slices) and reductions (whole gradients), and the seconds the
        # training thread waited for them
        "comm": _comm_stats(store),
        # parameters and optimizer state kept in fewer bytes (precision.storage_dtype with an
        # optimizer, precision.optimizer_state_dtype): the bytes their transfers moved, and
        # what moving the values as they are would have taken
        "compression": _compression_stats(store),
        # the parameters as stored between uses (precision.storage_dtype; int8/int4 quantize
        # the weights): a forward that gathers each once moves these bytes to the device
        "weights": _weight_stats(store),
        # saved activations moved off the device (offload_activations; None when 'none')
        "activations": store.activations.stats() if store.activations is not None else None,
    }


def _compression_stats(store: AttachedStore) -> dict[str, Any]:
    placement = store.placement
    moved = placement.compressed if placement is not None else None
    return {
        "optimizer_state_dtype": store.config.precision.optimizer_state_dtype,
        "state_read": moved.state_read if moved else 0,
        "state_read_as_fp32": moved.state_read_as_fp32 if moved else 0,
        "state_written": moved.state_written if moved else 0,
        "state_written_as_fp32": moved.state_written_as_fp32 if moved else 0,
        # compute copies (precision.storage_dtype with an optimizer): read by gathers instead
        # of their masters, and written beside them
        "compute_copies": bool(placement and placement.settings.compute_copy_dtype),
        "compute_read": moved.compute_read if moved else 0,
        "compute_read_as_masters": moved.compute_read_as_masters if moved else 0,
        "compute_written": moved.compute_written if moved else 0,
    }


def _weight_stats(store: AttachedStore) -> dict[str, Any]:
    entries = store.registry.entries
    quantized = [e for e in entries if e.quantized]
    return {
        "storage_dtype": store.config.precision.storage_dtype,
        "stored_bytes": sum(e.nbytes for e in entries),
        # the quantized weights' bytes (codes and scales), and those of the tensors kept as
        # they are (norms, biases, small ones)
        "quantized_bytes": sum(e.nbytes for e in quantized),
        "unquantized_bytes": sum(e.nbytes for e in entries if not e.quantized),
        "quantized_params": len(quantized),
        # the same parameters in the dtype they were given in
        "given_bytes": sum(e.numel * (e.given_dtype or e.dtype).itemsize for e in entries),
    }


def _comm_stats(store: AttachedStore) -> dict[str, Any] | None:
    partition = store.partition
    if partition is None:
        return None
    stats = partition.stats
    return {
        "rank": partition.rank,
        "world": partition.world,
        "stage": partition.stage,
        "backend": partition.backend,
        "gathered_bytes": stats.gathered_bytes,
        "reduced_bytes": stats.reduced_bytes,
        "gather_seconds": stats.gather_seconds,
        "reduce_seconds": stats.reduce_seconds,
        # every collective; of them, all-gathers of parameters and reductions of gradients
        # (one per bucket, see infinity.ranks.buckets)
        "collectives": stats.collectives,
        "all_gathers": stats.all_gathers,
        "reductions": stats.reductions,
        # device copies whose all-gathers started while the module before computed
        "assembled_ahead": store.placement.copies.assembled_ahead if store.placement else 0,
    }
