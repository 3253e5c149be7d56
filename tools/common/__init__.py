"""What the command-line tools and benchmarks share: argument parsing, units, aggregation, the
machine's description, the demo's GPT, and a run measured against its prediction."""
