"""The buckets of the collectives across ranks, decided at attach (infinity.ranks.buckets), and
the copies between a bucket's rows and a piece (infinity.ranks.collectives), in one process:
which shards travel together, where each sits in the rows, padding, and bad bucket sizes."""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.core.shards import ShardRegistry
from infinity.ranks.buckets import BucketLayout
from infinity.ranks.collectives import ScratchBuffers, flat_to_rows, rows_to_flat
from infinity.ranks.partition import Partition

WORLD = 2


class _Geometry:
    """Rank 0's slices of ``WORLD`` ranks: what the registry asks of a partition."""

    world = WORLD
    rank = 0

    def slice_of(self, start: int, numel: int) -> tuple[int, int, int]:
        return Partition.slice_of(self, start, numel)  # type: ignore[arg-type]


def _mlp_registry(layers: int, width: int, buffer_size: int = 1 << 20) -> ShardRegistry:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    registry = ShardRegistry()
    for name, param in model.named_parameters():
        registry.add_param(name, param, buffer_size, partition=_Geometry())  # type: ignore[arg-type]
    return registry


def _modules(registry: ShardRegistry) -> list[list]:
    """Each Linear's (weight, bias), in module order."""
    entries = registry.entries
    return [entries[i : i + 2] for i in range(0, len(entries), 2)]


def test_large_parameters_travel_alone_and_small_ones_together():
    registry = _mlp_registry(layers=4, width=64)  # weights 16 KiB whole, biases 256 bytes
    layout = BucketLayout(
        registry.entries, _modules(registry), frozenset(), WORLD, 16 << 10, 16 << 10
    )
    weights = [e for e in registry.entries if e.name.endswith("weight")]
    biases = [e for e in registry.entries if e.name.endswith("bias")]
    for weight in weights:
        (bucket,) = layout.gather_buckets_of(weight)
        assert bucket.entries == (weight,) and bucket.per_rank == 64 * 64 // WORLD
    (shared,) = {b for bias in biases for b in layout.gather_buckets_of(bias)}
    assert shared.entries == tuple(biases)  # in module order
    assert shared.offsets == (0, 32, 64, 96) and shared.per_rank == 128
    assert len(layout.gather_buckets) == 5
    # Gradients: the same grouping, last module first (the order backward completes them).
    assert [b.shards[0].entry.name for b in layout.reduce_buckets if len(b.shards) == 1] == [
        "3.weight",
        "2.weight",
        "1.weight",
        "0.weight",
    ]
    (grads,) = [b for b in layout.reduce_buckets if len(b.shards) > 1]
    assert [s.entry.name for s in grads.shards] == ["3.bias", "2.bias", "1.bias", "0.bias"]


def test_small_buckets_close_at_their_size_and_persistent_ones_stay_apart():
    registry = _mlp_registry(layers=6, width=8)  # weights 256 bytes whole, biases 32
    entries = registry.entries
    persistent = frozenset(e.index for e in entries if e.name.endswith("bias"))
    layout = BucketLayout(entries, _modules(registry), persistent, WORLD, 600, 600)
    for bucket in layout.gather_buckets:
        kinds = {e.index in persistent for e in bucket.entries}
        assert len(kinds) == 1, bucket.entries  # persistent ones only with persistent ones
        assert bucket.whole_bytes(WORLD) <= 600
    weights = [b for b in layout.gather_buckets if b.entries[0].name.endswith("weight")]
    assert [len(b.entries) for b in weights] == [2, 2, 2]  # 2 x 256 of 600: full at two
    # Every entry is in buckets, whole: a small parameter's shards all in one.
    for entry in entries:
        (bucket,) = layout.gather_buckets_of(entry)
        assert set(entry.shards) <= set(bucket.shards)


def test_a_large_parameter_of_several_pieces_gets_buckets_of_its_own():
    # buffer_size 1 KiB: each rank's slice at most 256 fp32 elements, so a 64 x 64 weight is
    # 8 pieces of 512 elements (2 KiB whole each).
    registry = _mlp_registry(layers=1, width=64, buffer_size=1024)
    weight, bias = registry.entries
    assert len(weight.shards) == 8
    layout = BucketLayout(registry.entries, _modules(registry), frozenset(), WORLD, 4096, 4096)
    buckets = layout.gather_buckets_of(weight)
    assert [len(b.shards) for b in buckets] == [1] * 8  # each piece half a bucket: alone
    assert all(b.entries == (weight,) for b in buckets)
    assert layout.gather_buckets_of(bias)[0].entries == (bias,)


def test_a_parameter_frozen_at_attach_gets_a_gradient_bucket_on_first_use():
    registry = _mlp_registry(layers=2, width=8)
    first = registry.entries[0]
    first.requires_grad = False
    layout = BucketLayout(
        registry.entries, _modules(registry), frozenset(), WORLD, 1 << 20, 1 << 20
    )
    assert all(first.shards[0] not in b.shards for b in layout.reduce_buckets)
    bucket = layout.reduce_bucket_of(first.shards[0])
    assert (
        bucket.shards == (first.shards[0],) and layout.reduce_bucket_of(first.shards[0]) is bucket
    )


@pytest.mark.parametrize("numel", [8, 7, 5, 1])
def test_rows_and_pieces_round_trip_with_padding(numel):
    per_rank = 4  # world 2: a piece of up to 8 elements
    piece = torch.arange(1, numel + 1, dtype=torch.float32)
    rows = torch.full((WORLD, 10), -1.0)
    flat_to_rows(piece, rows[:, 3 : 3 + per_rank])
    padded = torch.zeros(WORLD * per_rank)
    padded[:numel] = piece
    assert torch.equal(rows[:, 3 : 3 + per_rank].reshape(-1), padded)
    assert (rows[:, :3] == -1).all() and (rows[:, 3 + per_rank :] == -1).all()  # the others
    out = torch.zeros(numel)
    rows_to_flat(rows[:, 3 : 3 + per_rank], out)
    assert torch.equal(out, piece)


def test_scratch_buffers_are_reused_up_to_their_limit():
    scratch = ScratchBuffers(limit=64)
    first = scratch.take(8, torch.float32, torch.device("cpu"))
    scratch.give(first)
    assert scratch.take(8, torch.float32, torch.device("cpu")) is first
    scratch.give(first)
    scratch.give(torch.empty(16))  # 64 bytes more than the limit leaves: not kept
    assert scratch.take(16, torch.float32, torch.device("cpu")) is not first


@pytest.mark.parametrize("key, value", [("reduce_bucket_size", 0), ("allgather_bucket_size", 0)])
def test_a_bucket_size_that_is_not_positive_is_refused(key, value):
    with pytest.raises(infinity.ConfigError, match=f"{key}=0 is invalid: .*positive size"):
        infinity.OffloadConfig(**{key: value})
    with pytest.raises(infinity.ConfigError, match="prefetch_bucket_size=-1 is invalid"):
        infinity.OffloadConfig(prefetch_bucket_size=-1)


def test_deepspeed_bucket_sizes_map_in_elements():
    config = infinity.OffloadConfig.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "allgather_bucket_size": 1e6,
                "reduce_bucket_size": 2e6,
                "stage3_prefetch_bucket_size": "8MiB",
            },
            "bf16": {"enabled": True},
        }
    )
    assert config.allgather_bucket_size == 2_000_000  # bf16 elements
    assert config.reduce_bucket_size == 4_000_000
    assert config.prefetch_bucket_size == 8 << 20 == config.prefetch_bytes
