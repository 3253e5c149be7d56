"""Checkpoints of an attached store on torch.distributed.checkpoint (DCP): saved and loaded
shard by shard through the tiers, never the whole model in memory, resharded to another number
of ranks on load, and never unpickled (:mod:`infinity.checkpointing.storage`).

What a checkpoint holds:

* ``param/<name>``: each parameter's fp32 master (the parameter itself in fp32 training) as a
  flat tensor of its elements; each rank writes its own slices as DCP chunks (offset, length),
  so DCP knows where every element is and a load on another world size reads the overlaps.
* ``optim/<name>/<key>``: the optimizer's per-element state (AdamW's moments), in the same
  layout.
* ``infinity.json``: everything that is not a per-element tensor, as JSON: the parameters'
  shapes, the optimizer's class, param groups (learning rates as a scheduler left them) and
  scalar state (``step``), the loss scaler, the store's step counts, each rank's RNG states and
  the caller's ``extra`` (an LR scheduler's state_dict, the data position).
* ``config.json``: a Hugging Face model's config, when the model has one (``infinity-export``
  copies it next to the weights).

Tensors are read from wherever they live only when DCP's writer asks for them (the planner's
``resolve_data``), one chunk at a time, and a load writes each chunk into its shard through the
tiers as soon as its bytes are in (``commit_tensor``): host memory for either is about one
shard's worth, not the model's.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from infinity.checkpointing.async_save import AsyncSave
from infinity.checkpointing.dcp_planners import (
    ShardLoadPlanner,
    ShardSavePlanner,
    chunks_of,
    per_element,
)
from infinity.checkpointing.storage import (
    PARTIAL_SUFFIX,
    InfinityStorageReader,
    InfinityStorageWriter,
)
from infinity.core.budgets import CHECKPOINT_BUFFER_MAX, CHECKPOINT_WRITE_BUFFERS
from infinity.core.residency import Residency as R
from infinity.errors import CheckpointError, InfinityError
from infinity.training.optimizer import (
    KERNEL_KEYS,
    state_companions,
    step_param_of,
)

if TYPE_CHECKING:
    from infinity.core.attached import AttachedStore


log = logging.getLogger(__name__)

STATE_NAME = "infinity.json"
STATE_FORMAT = "infinity-state-1"


class Checkpointer:
    """Saves and loads one attached store's training state; see the module docstring."""

    def __init__(self, store: AttachedStore) -> None:
        self.store = store
        placement = store.placement
        assert placement is not None  # made by TieredStore._checkpointer, once attached
        self.placement = placement
        #: figures of the last save / load (seconds, bytes), for tools and logs
        self.last: dict[str, float] = {}
        #: an asynchronous save under way
        self.pending: AsyncSave | None = None
        self._group: Any = None

    # -- save -----------------------------------------------------------------------------------
    def save(self, path: Path, extra: Any = None, async_save: bool = False) -> None:
        """Saves now; with ``async_save`` the files are written by a background thread while
        training goes on (:mod:`infinity.checkpointing.async_save`), and :meth:`wait` completes
        it."""
        self.wait()  # one save at a time: the previous one first
        store = self.store
        path = Path(path)
        started = time.perf_counter()
        coordinator = _rank() == 0
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        if coordinator:
            path.parent.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)  # a save that did not finish
            partial.mkdir()
        _barrier()
        self.placement.gradients.finish_reductions()
        # Masters are read from the host or NVMe, never from a device copy (which may be in
        # a lower precision, and whose host slot may be gone): device copies go first, and the
        # persistent ones come back after (in entry order: across ranks they are gathers).
        dropped = self._drop_device_copies("save_checkpoint()")
        files = {STATE_NAME: json.dumps(self._state(extra))}
        config = getattr(store.model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            files["config.json"] = config.to_json_string()
        plan = store.memory_plan
        writer = InfinityStorageWriter(
            path,
            extra_files=files if coordinator else None,
            buffer_size=plan.checkpoint_buffer_size if plan is not None else CHECKPOINT_BUFFER_MAX,
            buffer_count=CHECKPOINT_WRITE_BUFFERS,
        )
        planner = ShardSavePlanner(store)
        planner.prepare()
        if async_save:
            pending = AsyncSave(
                [
                    ((key, shard.start), (shard, state_key))
                    for key, shard, state_key in chunks_of(store)
                ],
                lambda source: planner.read(*source),
                cap_bytes=store.config.checkpoint_staging,
                readable=lambda source: (
                    source[1] is not None or source[0].state is not R.DEVICE_NVME
                ),
            )
            planner.stream_from(pending)
            group = self._checkpoint_group()

            def write() -> None:
                self._run_save(path, writer, planner, group)
                self.last = {
                    "save_seconds": time.perf_counter() - started,
                    "bytes_written": writer.bytes_written,
                    "copied_before_change": pending.copied_before_change,
                    "step_wait_seconds": pending.wait_seconds,
                }

            pending.start(write)
            self.pending = pending  # copied out from the next module hook or change on
        else:
            self._run_save(path, writer, planner, _group(store))
            _barrier()
            self.last = {
                "save_seconds": time.perf_counter() - started,
                "bytes_written": writer.bytes_written,
            }
        self._restore_device_copies(dropped)
        if not async_save:
            log.info(
                "checkpoint %s saved: %d bytes from this rank in %.2f s",
                path,
                writer.bytes_written,
                self.last["save_seconds"],
            )

    def _drop_device_copies(self, what: str) -> list[Any]:
        """Masters are read from the host or NVMe, never from a device copy (which may be in a
        lower precision, and whose host slot may be gone): device copies go first. Called at
        the same point on every rank (across ranks, what comes back is gathered)."""
        store = self.store
        held = [e.name for e in store.registry.entries if e.holds]
        if held:
            raise CheckpointError(
                f"{what} while {held[0]} is in use (a forward, a backward or "
                f"store.gathered()): call it between steps"
            )
        dropped = [e for e in store.registry.entries if e.resident]
        for entry in dropped:
            self.placement.drop_device(entry, force=True)
        return dropped

    def _restore_device_copies(self, dropped: list[Any]) -> None:
        """Persistent device copies come back (in entry order: across ranks, gathers)."""
        placement = self.placement
        for entry in dropped:
            if entry.index in placement.persistent:
                placement.gather(entry, hold=False)

    @staticmethod
    def _run_save(
        path: Path, writer: InfinityStorageWriter, planner: ShardSavePlanner, group: Any
    ) -> None:
        try:
            with _single_process_quiet():
                dcp.save(
                    {},
                    storage_writer=writer,
                    planner=planner,
                    process_group=group,
                    no_dist=not _distributed(),
                )
        except CheckpointException as exc:
            raise _unwrapped(exc, f"saving the checkpoint {path}") from None

    def _checkpoint_group(self) -> Any:
        """A process group of its own for saves in the background: collectives of two threads
        on one group would interleave differently on each rank."""
        if not _distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(
                ranks=dist.get_process_group_ranks(_group(self.store) or dist.group.WORLD),
                backend="gloo",
            )
        return self._group

    # -- an asynchronous save under way -----------------------------------------------------------
    def progress(self) -> None:
        """Copies a little more of a save under way out of the tiers (module hooks)."""
        if self.pending is not None:
            self.pending.advance()
            if not self.pending.active:  # the writer is done: every chunk was copied out
                self.wait(between_steps=False)

    def before_change(self, shards: Any) -> None:
        """Before ``shards`` change (a step, a write): what a save under way still needs of
        them is copied first."""
        if self.pending is not None:
            self.pending.before_change(shards)

    def wait(self, between_steps: bool = True) -> None:
        """Completes a save under way (copying out what is left), raising its failure.
        ``between_steps``: called at the same point on every rank, outside forward and
        backward."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        # What is left may include masters whose host copies went while their device copies
        # were cached: device copies go first, as in a save (on every rank alike, whatever
        # this rank's writer has done: across ranks their return is a collective).
        dropped = self._drop_device_copies("wait_for_checkpoint()") if between_steps else []
        try:
            pending.finish()
        finally:
            self._restore_device_copies(dropped)
        log.info(
            "checkpoint saved in the background: %d bytes from this rank in %.2f s, %d "
            "chunks copied before a change, the training waited %.3f s",
            self.last.get("bytes_written", 0),
            self.last.get("save_seconds", 0.0),
            pending.copied_before_change,
            pending.wait_seconds,
        )

    def _state(self, extra: Any) -> dict:
        store = self.store
        optimizer = store.optimizer
        state = {
            "format": STATE_FORMAT,
            "world": _world(),
            "zero_stage": store.config.zero_stage,
            "steps": store.stepping.steps,
            "skipped_steps": store.stepping.skipped_steps,
            "params": {
                e.name: {"shape": list(e.shape), "dtype": str(e.dtype)}
                for e in store.registry.entries
            },
            "scaler": encode(store.scaler.state_dict()) if store.scaler is not None else None,
            "rng": _gather_rng(),
            "extra": encode(extra, "extra"),
            "optimizer": self._optimizer_state(optimizer) if optimizer is not None else None,
        }
        return state

    @staticmethod
    def _optimizer_state(optimizer: Any) -> dict:
        inner = optimizer.inner
        shard_of = {id(s.step_param): s for s in optimizer.shards}
        groups = []
        for group in inner.param_groups:
            names: list[str] = []
            for param in group["params"]:
                name = shard_of[id(param)].entry.name
                if name not in names:
                    names.append(name)
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({"settings": encode(settings, "param_groups"), "params": names})
        scalars: dict[str, Any] = {}
        for shard in optimizer.shards:
            if shard.entry.name in scalars:
                continue
            swapped = state_companions(shard) if optimizer.swap_state else {}
            values = {
                key: value
                for key, value in inner.state.get(shard.step_param, {}).items()
                if not per_element(value, shard) and key not in swapped
            }
            scalars[shard.entry.name] = encode(values, "optimizer state")
        return {"class": type(inner).__name__, "param_groups": groups, "scalars": scalars}

    # -- load -----------------------------------------------------------------------------------
    def load(self, path: Path) -> Any:
        self.wait()  # a save under way reads what the load would overwrite
        store = self.store
        path = Path(path)
        started = time.perf_counter()
        reader = InfinityStorageReader(path)  # checks that it is a checkpoint first
        state_file = path / STATE_NAME
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{state_file} cannot be read: {exc}") from exc
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{state_file} is not an infinity state file")
        self._check_model(path, state)
        optimizer = store.optimizer
        if optimizer is not None and state["optimizer"] is not None:
            saved_class = state["optimizer"]["class"]
            if saved_class != type(optimizer.inner).__name__:
                raise CheckpointError(
                    f"{path} holds the state of a {saved_class}, the attached "
                    f"optimizer is a {type(optimizer.inner).__name__}"
                )
            self._load_optimizer_scalars(state["optimizer"])
        placement = self.placement
        placement.gradients.finish_reductions()
        # Every value is overwritten: no device copy may outlive it (the persistent ones come
        # back in planner.finish()).
        self._drop_device_copies("load_checkpoint()")
        planner = ShardLoadPlanner(
            store, load_optimizer=optimizer is not None and state["optimizer"] is not None
        )
        try:
            with _single_process_quiet():
                dcp.load(
                    {},
                    storage_reader=reader,
                    planner=planner,
                    process_group=_group(store),
                    no_dist=not _distributed(),
                )
        except CheckpointException as exc:
            raise _unwrapped(exc, f"loading the checkpoint {path}") from None
        planner.finish()
        store.stepping.restore_counts(state["steps"], state["skipped_steps"])
        if store.scaler is not None and state["scaler"] is not None:
            store.scaler.load_state_dict(decode(state["scaler"]))
            placement.gradients.set_loss_scale(store.scaler.scale)
        rng = state.get("rng") or []
        if len(rng) == _world():
            _set_rng(rng[_rank()])
        else:
            log.info(
                "checkpoint %s was saved by %d ranks, this run has %d: RNG states not restored",
                path,
                len(rng),
                _world(),
            )
        self.last = {
            "load_seconds": time.perf_counter() - started,
            "bytes_read": reader.chunks.bytes_read,
        }
        log.info(
            "checkpoint %s loaded: %d bytes read by this rank in %.2f s",
            path,
            reader.chunks.bytes_read,
            self.last["load_seconds"],
        )
        return decode(state["extra"])

    def _check_model(self, path: Path, state: dict) -> None:
        saved = state["params"]
        own = {e.name: e for e in self.store.registry.entries}
        missing = [n for n in own if n not in saved]
        unexpected = [n for n in saved if n not in own]
        wrong = [
            f"{n}: {saved[n]['shape']} saved, {list(e.shape)} here"
            for n, e in own.items()
            if n in saved and saved[n]["shape"] != list(e.shape)
        ]
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"{path} is a checkpoint of another model: "
                + "; ".join(
                    part
                    for part in (
                        f"missing {missing[:5]}" if missing else "",
                        f"unexpected {unexpected[:5]}" if unexpected else "",
                        f"shapes differ: {wrong[:5]}" if wrong else "",
                    )
                    if part
                )
            )

    def _load_optimizer_scalars(self, saved: dict) -> None:
        optimizer = self.store.optimizer
        assert optimizer is not None  # load() checked
        inner = optimizer.inner
        groups = saved["param_groups"]
        if len(groups) != len(inner.param_groups):
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(groups)} param groups, "
                f"the attached one {len(inner.param_groups)}"
            )
        for group, saved_group in zip(inner.param_groups, groups):
            for key, value in decode(saved_group["settings"]).items():
                if key not in KERNEL_KEYS:  # the store's kernel choice stays
                    group[key] = value
        scalars = saved["scalars"]
        for shard in optimizer.shards:
            values = decode(scalars.get(shard.entry.name, {}))
            inner.state[step_param_of(shard)] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()
            }


def _unwrapped(exc: Any, what: str) -> BaseException:
    """DCP gathers each rank's failure into one CheckpointException (a BaseException): the
    first failure itself when it is ours (it names the file), else a CheckpointError."""
    for rank, (failure, _) in sorted(exc.failures.items()):
        if isinstance(failure, InfinityError):
            return failure
        return CheckpointError(f"{what} failed on rank {rank}: {type(failure).__name__}: {failure}")
    return CheckpointError(f"{what} failed: {exc}")


def encode(value: Any, where: str = "value") -> Any:
    """``value`` as JSON: numbers, strings, lists and str-keyed dicts as they are; tensors,
    tuples and dicts with other keys tagged, so :func:`decode` gives them back."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return (
            value if value == value and abs(value) != float("inf") else {"__float__": repr(value)}
        )
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        if tensor.numel() > 1 << 20:
            raise CheckpointError(
                f"{where}: a tensor of {tensor.numel()} elements is too large "
                f"for the checkpoint's JSON part"
            )
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return {
            "__tensor__": {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "data": base64.b64encode(data).decode(),
            }
        }
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"__items__": [[encode(k, where), encode(v, where)] for k, v in value.items()]}
    raise CheckpointError(
        f"{where}: a {type(value).__name__} cannot go into a checkpoint "
        f"(numbers, strings, lists, dicts and tensors can; nothing is "
        f"pickled)"
    )


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        from infinity.checkpointing.storage import dtype_of, tensor_from

        info = value["__tensor__"]
        return tensor_from(
            base64.b64decode(info["data"]), dtype_of(info["dtype"]), tuple(info["shape"])
        ).clone()
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if "__float__" in value:
        return float(value["__float__"])
    return {k: decode(v) for k, v in value.items()}


# -- ranks and RNG ---------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _group(store: AttachedStore) -> Any:
    return store.partition.group if store.partition is not None else None


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (no_dist): one process is a
    normal case here, not a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rng_state() -> dict:
    state = {"cpu": encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _gather_rng() -> list:
    own = _rng_state()
    if not _distributed() or _world() == 1:
        return [own]
    states: list[Any] = [None] * _world()
    dist.all_gather_object(states, own)
    return states


def _set_rng(state: dict) -> None:
    torch.set_rng_state(decode(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [decode(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
