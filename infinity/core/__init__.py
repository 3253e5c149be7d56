"""The core: the store, where each shard lives (placement, residency, shards), the tiers and their
memory, and the trace-fed prefetch and eviction policies."""
