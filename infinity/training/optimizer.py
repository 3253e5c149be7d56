"""The optimizer the store hands back: the user's own optimizer class, run on host masters.

Each shard gets a host ``nn.Parameter`` (its "step parameter") that the user's optimizer class
updates. Between steps the step parameter holds an empty placeholder; during a step it is pointed
at the shard's host copy and its host gradient, in tiles that fit the staging arena when the
shards live on NVMe: the next tile is read while the current one is updated, and each updated
tile is written back behind. Optimizers skip parameters whose ``grad`` is None, so running the
step once per tile updates exactly that tile.

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are
the inner optimizer's own objects, so LR schedulers and code that edits ``param_groups`` work.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from infinity.core.residency import Residency as R
from infinity.core.shards import OPTIM_PREFIX, ParamEntry, Shard, ShardRegistry, state_companions
from infinity.errors import AttachError
from infinity.training import fused_adam
from infinity.training.fused_adam import AdamSettings, FusedAdam, KernelShard
from infinity.training.master_rounding import UPDATE_DTYPE, StochasticMasters, rounding_seed
from infinity.training.scratch import DecodeScratch
from infinity.training.state_codecs import Int8Codec, StateCodec, codec_for
from infinity.training.step_params import StepParams

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore
    from infinity.core.placement import Placement

log = logging.getLogger(__name__)


def _empty(shard: Shard, device: str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=dtype or shard.dtype, device=device)


def _rounds_masters(store: AttachedStore) -> bool:
    """bf16 masters updated in fp32 and rounded back (precision.master_dtype='bf16')."""
    return store.config.precision.widened_masters


class OffloadedOptimizer(Optimizer):
    """See the module docstring. Build it with :meth:`wrap`."""

    def __init__(
        self,
        store: AttachedStore,
        inner: Optimizer,
        shards: list[Shard],
        user_kernels: list[dict[str, Any]] | None = None,
    ) -> None:
        # Optimizer.__init__ would rebuild param_groups; share the inner optimizer's instead.
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self.store = store
        placement = store.placement
        assert placement is not None  # wrapped by attach, after the placement is made
        self.placement = placement
        self.inner = inner
        self.shards = shards
        self.state = inner.state
        self.param_groups = inner.param_groups
        #: per-element optimizer state lives in NVMe-backed companions, not in memory
        self.swap_state = store.config.offload_optimizer == "nvme"
        #: how fp32 per-element state is stored in its companions (None: as it is;
        #: precision.optimizer_state_dtype, infinity.training.state_codecs)
        self.codec: StateCodec | None = (
            codec_for(store.config.precision.optimizer_state_dtype) if self.swap_state else None
        )
        #: with a codec, the most elements the inner optimizer updates at once: the largest
        #: shard's, so that the decoded state is a transient of two of the largest shard
        self._group_numel = max((s.numel for s in shards), default=0)
        self._decoded = DecodeScratch(self._group_numel)
        #: where the host copies are: "meta" in the planner's simulation, which holds no bytes
        self._host_device = "meta" if placement.host.meta else "cpu"
        #: bf16 masters: widened to fp32 for the update and rounded back stochastically
        #: (precision.master_dtype, infinity.training.master_rounding); None: updated as kept
        self.rounding = (
            StochasticMasters(self._group_numel, self._host_device)
            if _rounds_masters(store)
            else None
        )
        #: the whole update chain (decode, widen, Adam, round, encode) in one pass, where it
        #: applies (infinity.training.fused_adam); None: torch operations
        self.fused = self._fused_kernel()
        #: the inner optimizer's own time and the elements it updated; the steps' time less
        #: their waits and copies per element updated; the last iteration's device copies
        #: (bytes, seconds): what the planner replays (infinity.planning.planner)
        self.update_seconds = 0.0
        self.updated_elements = 0
        self.step_seconds_per_element = 0.0  # the median of the last steps'
        self._step_rates: collections.deque[float] = collections.deque(maxlen=5)
        #: (elements updated, seconds of updates in backward) at the end of the last step
        self._rate_mark = (0, 0.0)
        self.last_copies: tuple[int, float] | None = None
        self._copies_mark: tuple[int, float] | None = None
        #: the last iteration's bytes read and written, its working seconds (its wall time less
        #: the training thread's waits for the disk) and those waits: the planner works out from
        #: them how much of the recorded compute ran beside the disk (Recording.iteration_io)
        self.last_iteration_io: tuple[int, int, float, float] | None = None
        self._io_mark: tuple[int, int, float, float] | None = None
        #: the kernel choices ("fused", "foreach") of the user's groups, which the store may
        #: have overridden inside: checkpoints carry the user's, loads keep the store's
        self._user_kernels = user_kernels or [{} for _ in inner.param_groups]
        #: between steps, p.grad of a step parameter is its shard's gradient (clipping over
        #: param_groups, as Lightning does)
        self.step_params = StepParams(store, shards, step_shape)

    @classmethod
    def wrap(cls, store: AttachedStore, optimizer: Optimizer) -> OffloadedOptimizer:
        registry = store.registry
        assert store.placement is not None  # wrapped by attach, after the placement is made
        device = "meta" if store.placement.host.meta else "cpu"
        rounds = _rounds_masters(store)
        groups = []
        shards: list[Shard] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                entry = registry.entry_of(param)
                if entry is None:
                    raise AttachError(
                        "the optimizer holds a parameter that is not part of the "
                        "attached model: build the optimizer from "
                        "model.parameters()"
                    )
                if id(param) in seen:
                    continue
                seen.add(id(param))
                for shard in entry.shards:
                    # Some optimizers (Adagrad) create state in their constructor with
                    # full_like(param): a zero-stride view has the right shape and costs nothing,
                    # while full_like of it still allocates a real, dense tensor.
                    shape = step_shape(shard)
                    dtype = _update_dtype(shard, rounds)
                    step_param = torch.nn.Parameter(
                        torch.zeros((), dtype=dtype, device=device).expand(shape),
                        requires_grad=entry.requires_grad,
                    )
                    shard.step_param = step_param
                    params.append(step_param)
                    shards.append(shard)
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": params, **settings})
        inner = _construct_like(optimizer, groups, store.config.fused_optimizer)
        _migrate_state(optimizer, inner, registry)
        for shard in shards:
            step_param_of(shard).data = _empty(shard, device, _update_dtype(shard, rounds))
        kernels = [
            {k: group[k] for k in KERNEL_KEYS if k in group} for group in optimizer.param_groups
        ]
        return cls(store, inner, shards, kernels)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        placement = self.placement
        started, busy = time.perf_counter(), placement.busy_seconds
        try:
            with self.step_params.plain():  # once for the whole step, not per tile
                self.store.stepping.run(self)
        finally:
            self._decoded.release()  # forward does not hold them
            if self.rounding is not None:
                self.rounding.release()
        # For the planner: the iteration's updates (in backward and in this step, with the
        # pipeline's bookkeeping around them) without their waits for the disk and their
        # device copies, per element updated (the median of the last steps: the first are
        # slower, creating state and faulting memory in); and the last iteration's device
        # copies (bytes, seconds).
        seconds = time.perf_counter() - started - (placement.busy_seconds - busy)
        elements, in_backward = self._rate_mark
        self._rate_mark = (self.updated_elements, placement.phase.backward_update_seconds)
        updated = self.updated_elements - elements
        if updated:
            seconds += placement.phase.backward_update_seconds - in_backward
            self._step_rates.append(seconds / updated)
            self.step_seconds_per_element = statistics.median(self._step_rates)
        device = placement.device
        copies = (device.bytes_in + device.bytes_out, device.copy_seconds)
        if self._copies_mark is not None:
            self.last_copies = (copies[0] - self._copies_mark[0], copies[1] - self._copies_mark[1])
        self._copies_mark = copies
        self._mark_iteration_io(placement)
        return loss

    def _mark_iteration_io(self, placement: Placement) -> None:
        engine = placement.engine
        stats = engine.stats() if engine is not None else None
        mark = (
            stats.bytes_read if stats is not None else 0,
            stats.bytes_written if stats is not None else 0,
            time.perf_counter(),
            placement.completions.stall_seconds,
        )
        if self._io_mark is not None:
            read, written, wall, waited = (now - then for now, then in zip(mark, self._io_mark))
            self.last_iteration_io = (int(read), int(written), max(0.0, wall - waited), waited)
        self._io_mark = mark

    def update(self, tile: list[Shard], grad_multiplier: float = 1.0) -> list[Shard]:
        """Runs the inner optimizer over ``tile``, whose host copies, gradients and (when
        swapped) optimizer-state companions are on the host. Returns the optimizer-state
        companions it filled or changed, for the caller to write back."""
        self.store.before_state_change(tile)  # a checkpoint being saved copies them first
        self.placement.copies.wait_host_reads(tile)  # device copies still reading the masters
        changed: list[Shard] = []
        for group in self._groups(tile):
            changed += self._update(group, grad_multiplier)
        return changed

    def _groups(self, tile: list[Shard]) -> list[list[Shard]]:
        """The tile as the groups the inner optimizer updates at once: the whole of it, or with
        a codec or rounded masters consecutive shards of at most the largest shard's elements
        (their state, or their masters, are widened for the update: see ``_group_numel``)."""
        if self.codec is None and self.rounding is None:
            return [tile]
        groups: list[list[Shard]] = []
        numel = 0
        for shard in tile:
            if not groups or numel + shard.numel > self._group_numel:
                groups.append([])
                numel = 0
            groups[-1].append(shard)
            numel += shard.numel
        return groups

    def _fused_kernel(self) -> FusedAdam | None:
        if not self.swap_state or self._host_device != "cpu":
            return None
        if self.codec is None and self.rounding is None:
            return None  # torch's fused Adam is already one pass
        if type(self.inner) not in (torch.optim.Adam, torch.optim.AdamW):
            return None
        library = fused_adam.library()
        if library is None:
            return None
        return FusedAdam(library, self.codec.name if self.codec is not None else "fp32")

    def _fused_plan(
        self, tile: list[Shard]
    ) -> list[tuple[Shard, AdamSettings, torch.Tensor]] | None:
        """The tile's shards with a gradient, their settings and gradients, where the fused
        kernel updates every one of them as the inner optimizer would; None where it does not
        (the first step creates the state; other settings, layouts or keys)."""
        groups = {id(p): g for g in self.inner.param_groups for p in g["params"]}
        encoding = self.codec.name if self.codec is not None else None
        planned = []
        for shard in tile:
            param = step_param_of(shard)
            group = groups.get(id(param))
            settings = AdamSettings.of(self.inner, group) if group is not None else None
            state = self.inner.state.get(param)
            companions = state_companions(shard)
            if settings is None or not state or not isinstance(state.get("step"), torch.Tensor):
                return None
            if sorted(companions) != sorted(_ADAM_KEYS):
                return None
            if any(c.encoding != encoding for c in companions.values()):
                return None
            rounds = self.rounding is not None and self.rounding.applies(shard.dtype)
            if not rounds and shard.dtype != torch.float32:
                return None
            if rounds and shard.numel > self._group_numel:
                return None  # beyond the noise table the torch path draws its own
            grad = self.placement.gradients.grad_view(shard)
            if grad is None:
                continue  # the optimizer skips it
            if not grad.is_contiguous() or grad.dtype not in (torch.bfloat16, torch.float32):
                return None
            planned.append((shard, settings, grad))
        return planned

    def _update_fused(
        self,
        tile: list[Shard],
        planned: list[tuple[Shard, AdamSettings, torch.Tensor]],
        grad_multiplier: float,
    ) -> list[Shard]:
        fused, codec, rounding = self.fused, self.codec, self.rounding
        assert fused is not None
        placement = self.placement
        steps = self.store.stepping.steps
        started = time.perf_counter()
        changed: list[Shard] = []
        for shard, settings, grad in planned:
            companions = state_companions(shard)
            pair = [companions[key] for key in _ADAM_KEYS]
            stored = [c.host_copy() for c in pair]
            scales = None
            state_noise = None
            if codec is not None:
                seeds = [rounding_seed(f"{shard.id}/{key}", steps) for key in _ADAM_KEYS]
                noises = [codec.kernel_noise(seed, shard.numel) for seed in seeds]
                state_noise = (noises[0][0], (noises[0][1], noises[1][1]))
                if isinstance(codec, Int8Codec):
                    parts = [codec.parts(s, shard.numel) for s in stored]
                    scales = (parts[0][0], parts[1][0])
                    stored = [parts[0][1], parts[1][1]]
            master_noise = None
            if rounding is not None and rounding.applies(shard.dtype):
                seed = rounding_seed(shard.id, steps)
                master_noise = (rounding.permutation(), rounding.offset(seed))
            step = self.inner.state[step_param_of(shard)]["step"]
            step.add_(1)  # as torch's fused Adam counts, before its update
            kernel_shard = KernelShard(
                master=shard.host_copy().reshape(-1),
                grad=grad.reshape(-1),
                grad_factor=placement.gradients.take_grad_factor(shard, grad_multiplier),
                states=(stored[0][: shard.numel], stored[1][: shard.numel]),
                scales=scales,
                master_noise=master_noise,
                state_noise=state_noise,
            )
            fused.update(kernel_shard, settings, float(step))
            for companion in pair:
                if companion.state is not R.HOST:
                    self.store.registry.set_state(companion, R.HOST)
                changed.append(companion)
        self.update_seconds += time.perf_counter() - started
        self.updated_elements += sum(shard.numel for shard in tile)
        return changed

    def _update(self, tile: list[Shard], grad_multiplier: float) -> list[Shard]:
        if self.fused is not None:
            planned = self._fused_plan(tile)
            if planned is not None:
                return self._update_fused(tile, planned, grad_multiplier)
        placement = self.placement
        rounding = self.rounding
        bound: list[tuple[Shard, dict[str, Shard]]] = []
        for shard in tile:
            view = shard.host_copy().view(step_shape(shard))
            widen = rounding if rounding is not None and rounding.applies(shard.dtype) else None
            param = step_param_of(shard)
            param.data = widen.widen("master", view) if widen is not None else view
            grad = placement.gradients.grad_view(shard)
            if grad is not None:
                grad = grad.view_as(view)
                if widen is not None:
                    grad = widen.widen("grad", grad)
                # Clipping's factor, and any the loop recorded on p.grad (mul_, zero_).
                placement.gradients.apply_grad_multiplier(shard, grad, grad_multiplier)
            param.grad = grad
            companions = state_companions(shard) if self.swap_state else {}
            if companions:
                state = self.inner.state[param]
                for key, companion in companions.items():
                    into = None
                    if companion.encoding is not None and self._host_device == "cpu":
                        into = self._decoded.take(key, shard.numel)
                    state[key] = self.state_values(shard, key, companion, into)
            bound.append((shard, companions))
        started = time.perf_counter()
        stepped = False
        try:
            with self.step_params.plain():  # every one: the optimizer skips those without grad
                self.inner.step()
            stepped = True
        finally:
            self.update_seconds += time.perf_counter() - started
            self.updated_elements += sum(shard.numel for shard in tile)
            changed = []
            for shard, companions in bound:
                param = step_param_of(shard)
                if self.swap_state:
                    changed += self._stash_state(shard, companions)
                if stepped and rounding is not None and rounding.applies(shard.dtype):
                    seed = rounding_seed(shard.id, self.store.stepping.steps)
                    rounding.round_into(shard.host_copy(), param.data, seed)
                param.grad = None
                param.data = _empty(shard, self._host_device, param.dtype)
            self._decoded.reset()  # the group's state is encoded back: the next one reuses them
            if rounding is not None:
                rounding.reset()
        return changed

    def _stash_state(self, shard: Shard, companions: dict[str, Shard]) -> list[Shard]:
        """Moves the step parameter's per-element state tensors into companions (one per
        state key, each the size of the shard) and leaves empty placeholders in the optimizer;
        scalars such as ``step`` stay in memory."""
        state = self.inner.state.get(step_param_of(shard))
        if not state:
            return []
        placement = self.placement
        changed = []
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.numel() != shard.numel:
                continue
            companion = companions.get(key)
            if companion is None:
                companion = self._new_companion(shard, key, value)
                placement.fill(companion)
                placement.phase.pin(companion)  # the rest of this tile must not evict it
            if companion.encoding is not None:
                # Noise of this shard, key and step alone: the same in a resumed run, whatever
                # the order of the updates (module docstring of state_codecs).
                seed = rounding_seed(f"{shard.id}/{key}", self.store.stepping.steps)
                self._encode(companion, key, value, seed)
            else:
                view = companion.host_copy().view(value.shape)
                if value.data_ptr() != view.data_ptr() or value.stride() != view.stride():
                    view.copy_(value)  # new state, or the optimizer replaced the tensor
            state[key] = torch.empty(0, dtype=value.dtype, device=self._host_device)
            if companion.state is not R.HOST:
                self.store.registry.set_state(companion, R.HOST)
            changed.append(companion)
        return changed

    def _new_companion(self, shard: Shard, key: str, value: torch.Tensor) -> Shard:
        """The companion that will hold ``shard``'s state ``key`` (whose values are like
        ``value``): in the codec's bytes for fp32 state, else as it is."""
        codec = self.codec
        kind = OPTIM_PREFIX + key
        if codec is not None and value.dtype == torch.float32:
            numel, dtype = codec.stored(shard.numel)
            return self.placement.companion(shard, kind, numel, dtype, encoding=codec.name)
        return self.placement.companion(shard, kind, shard.numel, value.dtype)

    def _encode(self, companion: Shard, key: str, value: torch.Tensor, seed: int | None) -> None:
        """``value`` into ``companion``'s codes, rounded stochastically with the noise of
        ``seed``, or to nearest without one (loads: a decoded code comes back as that code)."""
        codec = self.codec
        assert codec is not None and companion.encoding == codec.name  # made by this store
        codec.encode(value.detach().reshape(-1).float(), companion.host_copy(), key, seed)

    def state_values(
        self, shard: Shard, key: str, companion: Shard, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The values of ``shard``'s state ``key`` that ``companion`` (on the host) holds, in
        the shard's step shape: its host copy itself, or (kept in fewer bytes) decoded into
        ``into`` (fp32, flat, the shard's elements) or else a new fp32 tensor."""
        stored = companion.host_copy()
        if companion.encoding is None:
            return stored.view(step_shape(shard))
        codec = self.codec
        assert codec is not None and companion.encoding == codec.name  # made by this store
        return codec.decode(stored, shard.numel, key, into).view(step_shape(shard))

    @staticmethod
    def state_dtype(companion: Shard) -> torch.dtype:
        """The dtype of the state values ``companion`` holds (fp32 when kept in fewer bytes)."""
        return torch.float32 if companion.encoding is not None else companion.dtype

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.store.stepping.abandon_unfinished()  # with its gradients
        self.placement.gradients.clear_grads(set_to_none)
        self.store.stepping.gradients_cleared()

    # -- state ----------------------------------------------------------------------------------
    # Checkpoints use the layout of the user's own optimizer (one entry per parameter, in the
    # order the optimizer was built with, per-element state whole), not the per-shard layout
    # inside: a checkpoint loads into the plain optimizer without the store, and back.
    def _entries(self) -> list[tuple[Any, list[Shard]]]:
        """(entry, its shards) in the user's parameter order."""
        order: dict[int, tuple[Any, list[Shard]]] = {}
        for shard in self.shards:
            order.setdefault(shard.entry.index, (shard.entry, []))[1].append(shard)
        return list(order.values())

    def _group_entries(self) -> list[list[int]]:
        """For each param group, the user indices of its parameters."""
        position = {entry.index: i for i, (entry, _) in enumerate(self._entries())}
        shard_of = {id(shard.step_param): shard for shard in self.shards}
        groups = []
        for group in self.inner.param_groups:
            ids: list[int] = []
            for param in group["params"]:
                i = position[shard_of[id(param)].entry.index]
                if i not in ids:
                    ids.append(i)
            groups.append(ids)
        return groups

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state in the user's optimizer's own layout, with real tensors:
        per-element state that lives on NVMe is read back (it takes host memory for the whole
        state; the copy is the caller's)."""
        self.store.stepping.loop_acted("optimizer.state_dict()")
        state: dict[int, dict[str, Any]] = {}
        for i, (entry, shards) in enumerate(self._entries()):
            merged = self._entry_state(entry, shards)
            if merged:
                state[i] = merged
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, **kernels, "params": ids}
            for group, kernels, ids in zip(
                self.inner.param_groups, self._user_kernels, self._group_entries()
            )
        ]
        return {"state": state, "param_groups": groups}

    def _entry_state(self, entry: ParamEntry, shards: list[Shard]) -> dict[str, Any]:
        placement = self.placement
        pieces: dict[str, list[torch.Tensor]] = {}
        merged: dict[str, Any] = {}
        for shard in shards:
            companions = state_companions(shard) if self.swap_state else {}
            for key, value in self.inner.state.get(step_param_of(shard), {}).items():
                if key in companions:
                    companion = companions[key]
                    placement.ensure_host(companion)  # read back from NVMe if it is there
                    # A copy now: the next read may reuse this slot (decoded values are one).
                    value = self.state_values(shard, key, companion)
                    if companion.encoding is None:
                        value = value.clone()
                if isinstance(value, torch.Tensor) and value.shape == step_shape(shard):
                    flat = value.detach().reshape(-1)
                    if shard.piece is not None:  # every rank's slice (a collective)
                        assert placement.partition is not None  # pieces exist across ranks
                        flat = placement.partition.gather_flat(flat, shard.piece[1])
                    pieces.setdefault(key, []).append(flat)
                    merged.setdefault(key, None)  # keeps the optimizer's key order
                elif key not in merged:
                    merged[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for key, parts in pieces.items():
            merged[key] = torch.cat(parts).view(entry.shape)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict in the user's optimizer's layout (from :meth:`state_dict`, or
        from the same optimizer class trained without the store)."""
        self.store.wait_for_checkpoint()  # a save under way still reads the old state
        saved_groups = state_dict["param_groups"]
        own_groups = self._group_entries()
        if len(saved_groups) != len(own_groups) or any(
            len(saved["params"]) != len(ids) for saved, ids in zip(saved_groups, own_groups)
        ):
            raise ValueError(
                f"the state dict has param groups of sizes "
                f"{[len(g['params']) for g in saved_groups]}, this optimizer "
                f"{[len(ids) for ids in own_groups]}: load a state dict saved from an optimizer "
                f"built over the same parameters"
            )
        entries = self._entries()
        saved_index: dict[int, int] = {}  # user index here -> index in the state dict
        for saved, ids in zip(saved_groups, own_groups):
            saved_index.update(zip(ids, saved["params"]))
        inner_index = {id(shard.step_param): k for k, shard in enumerate(self.shards)}
        inner_state: dict[int, dict[str, Any]] = {}
        for i, (entry, shards) in enumerate(entries):
            saved = state_dict["state"].get(saved_index[i])
            if not saved:
                continue
            for shard in shards:
                inner_state[inner_index[id(shard.step_param)]] = _split_state(saved, entry, shard)
        inner_groups = []
        for saved, group in zip(saved_groups, self.inner.param_groups):
            settings = {k: v for k, v in saved.items() if k != "params"}
            settings.update({k: group[k] for k in KERNEL_KEYS if k in group})
            inner_groups.append(
                {**settings, "params": [inner_index[id(p)] for p in group["params"]]}
            )
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        # Optimizer.load_state_dict replaces both objects: share the new ones.
        self.state = self.inner.state
        self.param_groups = self.inner.param_groups
        if self.swap_state:
            for shard in self.shards:
                self.stash_loaded_state(shard)

    def stash_loaded_state(self, shard: Shard, keep_others: bool = False) -> None:
        """Moves loaded per-element state into the shard's companions (overwriting what they
        held, without reading it) and drops companions the loaded state has no value for
        (unless ``keep_others``: a checkpoint load brings one key at a time)."""
        placement = self.placement
        registry = self.store.registry
        state = self.inner.state.get(step_param_of(shard), {})
        loaded = set()
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.shape != step_shape(shard):
                continue
            kind = OPTIM_PREFIX + key
            companion = shard.companions.get(kind)
            if companion is None:
                companion = self._new_companion(shard, key, value)
            if companion.encoding is None:
                value = value.to(companion.dtype)
            if companion.state is R.EMPTY:
                placement.fill(companion)
            else:
                placement.prepare_overwrite(companion)
                if companion.state is not R.HOST:
                    registry.set_state(companion, R.HOST)
            if companion.encoding is not None:
                # To nearest: the checkpoint of a store keeping this dtype holds decoded codes,
                # which come back as the same codes, so the resumed run goes on from them.
                self._encode(companion, key, value, None)
            else:
                companion.host_copy().copy_(value.reshape(-1))
            companion.version += 1
            state[key] = torch.empty(0, dtype=value.dtype, device=self._host_device)
            loaded.add(kind)
        if keep_others:
            return
        for kind, companion in list(shard.companions.items()):
            if kind.startswith(OPTIM_PREFIX) and kind not in loaded:
                placement.discard(companion)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "add parameter groups before attach: the store must shard every parameter it updates"
        )

    def __repr__(self) -> str:
        return f"Offloaded({self.inner!r})"


def _construct_like(
    optimizer: Optimizer, groups: list[dict[str, Any]], allow_fused: bool
) -> Optimizer:
    # The user's optimizer class: its constructor's arguments are its own, not Optimizer's.
    cls: Callable[..., Optimizer] = type(optimizer)
    defaults = dict(optimizer.defaults)
    if (
        allow_fused
        and cls in (torch.optim.Adam, torch.optim.AdamW)
        and _default_kernel(defaults, groups)
    ):
        # torch's fused CPU Adam/AdamW is the fastest correct host kernel available here
        # (about 5x the per-tensor loop on two cores); it only applies to default options.
        defaults["fused"] = True
        for group in groups:
            group["fused"] = True
    try:
        return cls(groups, **defaults)
    except TypeError:
        # Custom optimizers whose defaults are not all constructor arguments: every group
        # carries its settings, so the constructor's own defaults are overridden anyway.
        return cls(groups)


def _default_kernel(defaults: dict[str, Any], groups: list[dict[str, Any]]) -> bool:
    for settings in [defaults, *groups]:
        if (
            settings.get("foreach")
            or settings.get("fused") is False
            or settings.get("differentiable")
            or settings.get("capturable")
        ):
            return False
    return True


#: Adam's per-element state, in the fused kernel's order
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")
#: param-group keys that choose an update kernel, not the optimisation
KERNEL_KEYS = ("fused", "foreach")


def _update_dtype(shard: Shard, rounds: bool) -> torch.dtype:
    """The dtype the optimizer updates ``shard`` in: its master's, or fp32 for rounded bf16."""
    return UPDATE_DTYPE if rounds and StochasticMasters.applies(shard.dtype) else shard.dtype


def step_param_of(shard: Shard) -> torch.nn.Parameter:
    """The step parameter of a shard the optimizer updates (made by ``wrap``)."""
    param = shard.step_param
    assert param is not None, f"{shard} is not one the optimizer updates"
    return param


def step_shape(shard: Shard) -> torch.Size:
    """A whole parameter keeps its shape (optimizers like Adafactor depend on it); a piece of
    one is a flat range."""
    entry = shard.entry
    if shard.piece is not None:
        return torch.Size([shard.numel])  # this rank's slice of a piece, across ranks
    return entry.shape if len(entry.shards) == 1 else torch.Size([shard.numel])


def _split_state(state: dict[str, Any], entry: ParamEntry, shard: Shard) -> dict[str, Any]:
    """A parameter's optimizer state as its shard's: per-element tensors are cut like the
    parameter, everything else (``step`` counters, scalars) is copied."""
    moved = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == entry.shape:
            piece = shard.padded(shard.part_of(value.detach().reshape(-1)).to("cpu"))
            moved[key] = piece.clone().view(step_shape(shard))
        elif isinstance(value, torch.Tensor):
            moved[key] = value.detach().to("cpu").clone()
        else:
            moved[key] = value
    return moved


def _migrate_state(optimizer: Optimizer, inner: Optimizer, registry: ShardRegistry) -> None:
    """Carries state the user's optimizer already has (it stepped, or its constructor made
    some) over to the step parameters."""
    for param, state in optimizer.state.items():
        entry = registry.entry_of(param)
        if entry is None or not state:
            continue
        for shard in entry.shards:
            inner.state[step_param_of(shard)] = _split_state(state, entry, shard)
