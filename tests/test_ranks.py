"""Attaching under torch.distributed: what cannot run across ranks is refused on every rank
with the reason, and ranks that attach different models or configs are stopped before they
exchange anything; a group of one rank runs as a single process."""

from __future__ import annotations

import pytest
import torch

import infinity
from tests.dist_helpers import run_ranks


def _attach(rank: int, world: int, config: dict, per_rank: dict) -> str:
    width = per_rank.get(rank, 4)
    model = torch.nn.Linear(width, 4)
    store = infinity.TieredStore(infinity.OffloadConfig(device="cpu", **config))
    try:
        store.attach(model, torch.optim.AdamW(model.parameters()))
        return "attached" + (" (partitioned)" if store.partition is not None else "")
    except infinity.InfinityError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        store.close()


@pytest.mark.parametrize(
    "config, per_rank, expected",
    [
        ({"offload_param": "cpu"}, {}, "attached (partitioned)"),
        (
            {"offload_param": "nvme", "zero_stage": 2},
            {},
            "zero_stage=2 keeps every parameter whole",
        ),
        ({"offload_param": "cpu"}, {1: 5}, "RankError: ranks disagree on the model's parameters"),
    ],
)
def test_attach_across_two_ranks(config, per_rank, expected):
    outcome = run_ranks(_attach, 2, config, per_rank, timeout=120)
    for rank in range(2):
        assert expected in outcome[rank], outcome[rank]
        if not expected.startswith("attached") and "RankError" not in expected:
            assert f"rank {rank} of 2" in outcome[rank]


def test_a_group_of_one_rank_runs_as_one_process():
    assert run_ranks(_attach, 1, {"offload_param": "cpu"}, {}, timeout=120) == {0: "attached"}
