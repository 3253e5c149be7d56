"""The process's memory as the store watches it: its RSS besides the model at attach (the
bound's fixed part), the peaks (RSS, NVMe), and, under a host budget, the heap watch that lets
freed blocks be reused while RSS stays under the budgets' line (:mod:`infinity.core.memory`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import psutil
import torch
from torch import nn

from infinity.core.budgets import MemoryPlan
from infinity.core.memory import (
    HeapWatch,
    host_tensor_bytes,
    peak_resident_bytes,
    resident_bytes,
)
from infinity.core.placement import Placement
from infinity.core.shards import ParamEntry
from infinity.observability.reporting import MemoryFigures
from infinity.training.optimizer import OffloadedOptimizer

log = logging.getLogger("infinity.store")


class StoreMemory:
    """The store's memory figures and its heap watch (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # peaks are sampled from other threads too (stats())
        #: the process's RSS at attach without the model's parameters (the bound's fixed part)
        self.process_bytes = 0
        #: the process's peak RSS (VmHWM) when attach returned: a model built whole in host
        #: memory is whole while attach writes it out, a peak training may never reach again
        self.attach_peak = 0
        #: RSS besides the tiers in the first step, with the heap bounded (0: not seen)
        self.bounded_base = 0
        self.rss_peak = 0
        self.nvme_peak = 0
        #: with a host budget: RSS kept under the budgets' line while heap blocks are reused
        self._heap_watch: HeapWatch | None = None

    @property
    def heap_watch(self) -> HeapWatch | None:
        """The heap watch (a host budget), or None."""
        return self._heap_watch

    @property
    def bounded(self) -> bool:
        """Whether a host budget bounds the heap (its watch is armed)."""
        return self._heap_watch is not None

    def measure_process(self, model: nn.Module) -> int:
        """The process without the model: what stays when the store holds the parameters."""
        model_bytes = sum(
            p.numel() * p.element_size()
            for p in model.parameters()
            if p.device.type == "cpu" and not p.is_meta
        )
        self.process_bytes = max(resident_bytes() - model_bytes, 0)
        return self.process_bytes

    def bound(self, plan: MemoryPlan) -> None:
        """Arms the heap watch under ``plan``'s line (a host budget), and logs the bound."""
        process = self.process_bytes
        self._heap_watch = HeapWatch(plan.heap_line(process))
        log.info(
            "RSS bound %d bytes: process %d + host_budget %d + device outside it %d + "
            "transients outside it %d, plus saved activations (measured: "
            "stats()['rss_bound']); heap reuse after the first step while RSS < %d",
            plan.static_bound(process),
            process,
            plan.host,
            plan.device_outside_host,
            plan.transient_outside,
            self._heap_watch.limit,
        )

    def attached(self) -> None:
        """Attach returned: its peak is the process's peak so far."""
        self.attach_peak = peak_resident_bytes()

    def first_step(
        self,
        plan: MemoryPlan,
        placement: Placement,
        optimizer: OffloadedOptimizer,
        entries: Sequence[ParamEntry],
        device: torch.device,
    ) -> None:
        """The first step is done: from now on every step allocates the same sizes, so freed
        blocks are reused instead of faulting fresh mappings, for as long as RSS stays under
        the line."""
        watch = self._heap_watch
        if watch is None:
            return
        # Expected to stay in the heap: the device tier's copies (host memory without a GPU)
        # and a few gradients and autograd temporaries of the largest parameter.
        largest = max(e.nbytes for e in entries)
        on_cpu = device.type == "cpu"
        tiers = placement.host.usage.peak + (placement.device.usage.peak if on_cpu else 0)
        # The process besides its tiers with the heap bounded, as the first step saw it: what
        # a prediction for a budget that leaves no room for reuse starts from.
        self.bounded_base = max(0, watch.seen_peak - tiers)
        # Host memory the user keeps outside the tiers (offload_optimizer="cpu": optimizer
        # state and gradients in host tensors) exists only now; the line moves up by it.
        gradients = placement.gradients
        outside = (0 if gradients.grads_on_nvme else gradients.grad_peak) + (
            0 if optimizer.swap_state else host_tensor_bytes(optimizer.inner.state)
        )
        watch.start(largest, plan.heap_reuse_wanted(largest, on_cpu), outside=outside)

    def check(self) -> None:
        """Called where the heap grows (module gathers, step tiles)."""
        if self._heap_watch is not None:
            self._heap_watch.check()

    def make_room(self, nbytes: int) -> None:
        """Returns heap blocks kept for reuse until ``nbytes`` more fit under the line."""
        if self._heap_watch is not None:
            self._heap_watch.make_room(nbytes)

    def sample(self, nvme_bytes: int) -> None:
        """Samples the peaks (from any thread)."""
        rss = psutil.Process().memory_info().rss
        with self._lock:  # a racing max() from another thread must not lower a peak
            self.rss_peak = max(self.rss_peak, rss)
            self.nvme_peak = max(self.nvme_peak, nvme_bytes)

    def rss_bound(
        self,
        plan: MemoryPlan,
        activations: int,
        optimizer: OffloadedOptimizer | None,
        placement: Placement | None,
    ) -> dict[str, int]:
        """The bound's terms (see infinity.core.budgets) with the saved ``activations``' peak,
        the process's own peak (VmHWM) and its peak when attach returned."""
        # offload_optimizer='cpu': the optimizer state and the gradients are host tensors that
        # host_budget does not cap (as they would be without the store)
        outside = 0
        if optimizer is not None and placement is not None and not optimizer.swap_state:
            outside = host_tensor_bytes(optimizer.inner.state)
            if not placement.gradients.grads_on_nvme:
                outside += placement.gradients.grad_peak
        static = plan.static_bound(self.process_bytes)
        return {
            "process": self.process_bytes,
            "host_budget": plan.host,
            "device_outside_host": plan.device_outside_host,
            "transient_outside_host": plan.transient_outside,
            "optimizer_outside_host": outside,
            "activations": activations,
            "bound": static + outside + activations,
            "peak": peak_resident_bytes(),
            "attach_peak": self.attach_peak,
            "bounded_base": self.bounded_base,
            "heap_reused": int(self._heap_watch is not None and self._heap_watch.started),
        }

    def figures(self, nvme_bytes: int, rss_bound: dict[str, int] | None) -> MemoryFigures:
        """What ``stats()`` reports of memory."""
        return MemoryFigures(
            nvme_bytes=nvme_bytes,
            nvme_peak=self.nvme_peak,
            rss_peak=self.rss_peak,
            heap_reuse=bool(self._heap_watch and self._heap_watch.active),
            rss_bound=rss_bound,
        )

    def stop(self) -> None:
        """Stops reusing heap blocks (before the parameters' memory is allocated at close; the
        next store in this process starts bounded again)."""
        if self._heap_watch is not None:
            self._heap_watch.stop()
