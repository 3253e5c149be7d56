"""Under torch.distributed with several ranks the store refuses to attach (it does not partition
across ranks yet) instead of training unsynchronised copies; a group of one rank works."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import infinity


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _attach_on_rank(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = torch.nn.Linear(4, 4)
        store = infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu"))
        try:
            store.attach(model, torch.optim.AdamW(model.parameters()))
            results.put((rank, "attached"))
        except infinity.AttachError as exc:
            results.put((rank, str(exc)))
        finally:
            store.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 1])
def test_attach_under_several_ranks_is_refused(world):
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_attach_on_rank, args=(rank, world, port, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    outcome = dict(results.get(timeout=10) for _ in processes)
    if world == 1:
        assert outcome == {0: "attached"}
    else:
        for rank in range(world):
            assert f"rank {rank} of {world}" in outcome[rank] and "one process" in outcome[rank]
