"""What the commands share, and the repository's benchmarks use: argument parsing, units,
aggregation, the machine's description, the demo's GPT, the swap-engine transfer probe, the
contention measurement, and a run measured against its prediction."""
