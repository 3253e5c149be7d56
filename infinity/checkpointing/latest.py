"""Which checkpoint a restarted job resumes from: the newest complete one under a directory.

A save writes into ``<path>.partial`` and renames it to ``<path>`` only once every rank's data
file is written and synced and the coordinator has written the metadata
(:mod:`infinity.checkpointing.storage`), so a rank killed during a save, synchronous or
asynchronous, leaves a ``.partial`` directory and never a half-written checkpoint under a
checkpoint's name. What is taken here as complete is checked again all the same, cheaply (no
tensor byte is read; every chunk's checksum is checked when it is loaded):

* ``metadata.json`` and ``infinity.json`` are there, readable and ours;
* every data file the metadata names is there and as long as the chunks it lists.

Anything else holding one of those files is passed over and logged with the reason: a
``.partial`` directory (a save that did not finish), a missing or short data file (a copy cut
short), an unreadable file. Directories holding neither (logs, exports) are not checkpoints and
are ignored.

Newest: the most optimizer steps done (the store's count, saved in ``infinity.json``); among
equals, the one whose metadata was written last. A checkpoint the publishing rename left as
``<path>.old`` (the process died between the rename of the old one and of the new one) is a
complete checkpoint and counts as any other.

Across ranks (``torch.distributed`` initialised) rank 0 looks and tells the others, so every
rank loads the same checkpoint whatever its own view of a shared file system: it is then a
collective, called on every rank.

Under ``torchrun --max-restarts N`` the restarted ranks must rendezvous on a store of their own:
on the store torchrun shares with the workers by default they can read the dead attempt's
addresses, and ``init_process_group`` fails ("Gloo connectFullMesh failed ... Connection
refused" with gloo and torch 2.13 here; pytorch/pytorch#135712 for NCCL). A warning says so
when the launch allows restarts on the shared store.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from infinity.checkpointing.checkpoint import STATE_FORMAT, STATE_NAME
from infinity.checkpointing.storage import (
    METADATA_NAME,
    PARTIAL_SUFFIX,
    read_metadata_document,
)
from infinity.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Complete:
    path: Path
    steps: int
    written: float  # metadata.json's modification time


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint directly under ``directory``; None when there is none
    (``directory`` missing, empty, or holding only saves that did not finish). Raises
    CheckpointError when ``directory`` is not a directory of checkpoints (a file, a checkpoint
    itself, unreadable). See the module docstring."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _newest(directory)
    if dist.get_rank() == 0:
        _check_restarts_rendezvous()
    answer: list[tuple[str, str | None] | None] = [None]
    if dist.get_rank() == 0:
        try:
            found = _newest(directory)
            answer[0] = ("found", None if found is None else str(found))
        except CheckpointError as exc:
            answer[0] = ("error", str(exc))  # raised on every rank, not only here
    dist.broadcast_object_list(answer, src=0)
    assert answer[0] is not None  # rank 0 sent it
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(f"{value} (seen by rank 0)")
    return None if value is None else Path(value)


def _check_restarts_rendezvous() -> None:
    """Warns (once) when torchrun allows restarts but the workers' process group lives on the
    store torchrun shares with them: see the module docstring."""
    global _warned_shared_store
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if (
        restarts > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and not _warned_shared_store
    ):
        _warned_shared_store = True
        log.warning(
            "torchrun allows %d restart(s), but the ranks' process group is on the store "
            "torchrun shares with them: restarted ranks may read the dead attempt's addresses "
            "and fail in init_process_group. Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "in the environment",
            restarts,
        )


_warned_shared_store = False


def _newest(directory: Path) -> Path | None:
    directory = Path(directory)
    if not directory.exists():
        log.info("no checkpoint to resume from: %s does not exist", directory)
        return None
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is not a directory: latest_checkpoint() takes the directory that "
            f"holds the checkpoints (save_checkpoint('{directory}/step-100') writes one there)"
        )
    if (directory / METADATA_NAME).exists():
        raise CheckpointError(
            f"{directory} is a checkpoint itself: pass the directory that holds the "
            f"checkpoints ({directory.parent}), or load this one with "
            f"load_checkpoint('{directory}')"
        )
    try:
        children = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError as exc:
        raise CheckpointError(
            f"cannot list the checkpoints in {directory}: {exc}; make it readable"
        ) from exc
    complete: list[_Complete] = []
    for child in children:
        if child.name.endswith(PARTIAL_SUFFIX):
            log.warning(
                "passed over %s: a save that did not finish (a rank was killed or stopped "
                "during it); the next save to %s replaces it",
                child,
                child.name.removesuffix(PARTIAL_SUFFIX),
            )
            continue
        try:
            found = _complete(child)
        except CheckpointError as exc:
            log.warning("passed over %s: it is incomplete: %s", child, exc)
            continue
        if found is not None:
            complete.append(found)
    if not complete:
        log.info("no complete checkpoint under %s", directory)
        return None
    newest = max(complete, key=lambda c: (c.steps, c.written, c.path.name))
    log.info(
        "newest complete checkpoint under %s: %s (%d steps done, %d complete in all)",
        directory,
        newest.path.name,
        newest.steps,
        len(complete),
    )
    return newest.path


def _complete(path: Path) -> _Complete | None:
    """``path`` as a complete checkpoint; None when it is no checkpoint at all; raises
    CheckpointError naming what is missing when it is an incomplete one."""
    metadata = path / METADATA_NAME
    state_file = path / STATE_NAME
    if not metadata.exists():
        if state_file.exists():
            raise CheckpointError(f"its {METADATA_NAME} is missing")
        log.debug("%s holds no checkpoint", path)
        return None
    document = read_metadata_document(path)
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"its {STATE_NAME} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"its {STATE_NAME} cannot be read: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"its {STATE_NAME} is not an infinity state file")
    ends: dict[str, int] = {}
    for location in document["storage"].values():
        end = location["offset"] + location["length"]
        ends[location["file"]] = max(ends.get(location["file"], 0), end)
    for name, end in sorted(ends.items()):
        try:
            size = os.stat(path / name).st_size
        except FileNotFoundError:
            raise CheckpointError(f"its data file {name} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"its data file {name} cannot be read: {exc}") from exc
        if size < end:
            raise CheckpointError(
                f"its data file {name} has {size} bytes, its chunks end at byte {end}"
            )
    steps = state.get("steps")
    return _Complete(path, steps if isinstance(steps, int) else 0, os.stat(metadata).st_mtime)
