"""The placement's self-check: every residency legal and backed by what it claims, every
tier's byte count equal to what its holders add up to and within budget, arena ranges
disjoint. Used by tests, the soak tool and debugging."""

from __future__ import annotations

from typing import Any

from infinity.core.residency import Residency as R
from infinity.core.shards import ShardKind
from swap import align_up


def audit(placement: Any) -> list[str]:
    """Checks the bookkeeping against itself (tests, the soak tool, debugging): every state
    legal and backed by what it claims, every tier's byte count equal to what its holders
    add up to and within budget, arena ranges disjoint. Returns the problems found.
    Call it on the training thread, between operations."""
    problems: list[str] = []
    shards = [s for p in placement.registry.shards.values() for s in (p, *p.companions.values())]
    ranges: list[tuple[int, int, str]] = []
    host_bytes = placement.completions.quarantined_bytes
    for shard in shards:
        state = shard.state
        if (
            shard.kind is ShardKind.PARAM
            and state is R.EMPTY
            and shard.entry.index not in placement.uninitialised
        ):
            problems.append(f"{shard.id}: a parameter shard has no valid copy")
        if state.in_flight != (shard.pending is not None):
            problems.append(
                f"{shard.id}: {state.name} with "
                f"{'a' if shard.pending is not None else 'no'} transfer pending"
            )
        if state.on_nvme and shard.extent is None:
            problems.append(f"{shard.id}: {state.name} without an NVMe extent")
        arena_backed = placement.nvme if shard.kind is ShardKind.PARAM else True
        wants_slot = arena_backed and (state.on_host or state is R.NVME_LOADING)
        if wants_slot != (shard in placement.in_arena):
            problems.append(
                f"{shard.id}: {state.name} but "
                f"{'in' if shard in placement.in_arena else 'not in'} the arena"
            )
        if shard in placement.in_arena:
            if shard.arena_offset is None or shard.host is None:
                problems.append(f"{shard.id}: in the arena without a slot")
            else:
                size = align_up(max(shard.nbytes, 1))
                ranges.append((shard.arena_offset, shard.arena_offset + size, shard.id))
                host_bytes += size
        elif shard.kind is ShardKind.PARAM and not arena_backed and state.on_host:
            host_bytes += shard.nbytes  # a standalone host tensor
        if shard.kind is ShardKind.PARAM and shard.piece is not None and state.on_device:
            # Across ranks the device copy is every rank's slices: the entry tracks it.
            problems.append(f"{shard.id}: {state.name}, a slice across ranks")
        elif shard.kind is ShardKind.PARAM and state.on_device != shard.entry.resident:
            problems.append(
                f"{shard.id}: {state.name} but the entry is "
                f"{'' if shard.entry.resident else 'not '}resident"
            )
    ranges += [
        (o, o + align_up(max(n, 1)), f"quarantine({i})")
        for o, n, i in placement.completions.quarantine
    ]
    ranges.sort()
    for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
        if start < end:
            problems.append(f"arena ranges of {a} and {b} overlap")
    on_nvme = sum(s.state is R.NVME for s in shards)
    if placement.registry.on_nvme != on_nvme:
        problems.append(
            f"the registry counts {placement.registry.on_nvme} shards only on NVMe, {on_nvme} are"
        )
    resident = {e for e in placement.registry.entries if e.resident}
    on_device = placement.copies.on_device
    if resident != on_device:
        problems.append("the entries marked resident are not the ones listed on the device")
    device_bytes = sum(e.device_bytes for e in on_device)
    for name, tier, expected in (
        ("device", placement.device, device_bytes),
        ("host", placement.host, host_bytes),
    ):
        if tier.usage.current != expected:
            problems.append(
                f"{name} tier counts {tier.usage.current} bytes, its holders add up to {expected}"
            )
        if tier.usage.current > tier.budget:
            problems.append(
                f"{name} tier holds {tier.usage.current} bytes over its budget of {tier.budget}"
            )
    return problems
