"""Command-line tools around the swap layer: ``infinity-bench`` (tools.commands.bench) and
helpers."""
