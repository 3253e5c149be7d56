"""What the benchmarks share: the peer-comparison MLP and its timed steps, the NVMe store
configuration of a run, and a steady I/O load beside training steps."""
