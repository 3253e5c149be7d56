"""Runs a function on several gloo ranks (processes forked from a fork server) for the
multi-rank tests, with a timeout, and collects what each rank returns."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: imported once by the fork server that starts the ranks, so that each rank starts in a
#: fraction of a second instead of importing torch again (seconds of CPU per rank on 2 cores);
#: torch._dynamo is what the first optimizer.step() or zero_grad() of every rank imports
#: (torch._disable_dynamo), and pytest what every test module that holds a rank function does
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "torch._dynamo",
    "infinity",
    "pytest",
]


def _context() -> Any:
    """A fork-server context: ranks fork from a server process that imported ``PRELOAD`` and
    never ran a torch op (so no thread pool is copied into them), as spawned ranks start fresh."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _entry(
    rank: int,
    world: int,
    port: int,
    function: Callable,
    args: tuple,
    results: Any,
    timeout: float,
    environment: dict[str, str],
) -> None:
    # The fork server's environment is the one it started with: take the caller's, as a
    # spawned process would have.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two cores, several ranks
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    try:
        results.put((rank, "ok", _portable(function(rank, world, *args))))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _portable(value: Any) -> Any:
    """``value`` with tensors as numpy arrays: a tensor sent through a queue is shared by a
    file descriptor that dies with its process."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value


def run_ranks(
    function: Callable,
    world: int,
    *args: Any,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
) -> dict[int, Any]:
    """``function(rank, world, *args)`` on ``world`` ranks (a module-level function: it is
    pickled); returns {rank: result}, tensors in it as numpy arrays. A rank that raised fails the
    call with its traceback; one that does not finish within ``timeout`` seconds is killed."""
    context = _context()
    results = context.Queue()
    port = free_port()
    environment = dict(os.environ)
    processes = [
        context.Process(
            target=_entry,
            args=(rank, world, port, function, args, results, collective_timeout, environment),
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    outcome: dict[int, tuple[str, Any]] = {}
    try:
        for _ in processes:
            rank, status, value = results.get(timeout=timeout)
            outcome[rank] = (status, value)
    except queue.Empty:
        pass
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {v}" for r, v in sorted(errors.items())))
    missing = [r for r in range(world) if r not in outcome]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout} s")
    return {r: v for r, (_, v) in outcome.items()}
