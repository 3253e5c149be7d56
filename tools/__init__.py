"""Command-line tools around the swap layer: ``infinity-bench`` (tools.bench) and helpers."""
