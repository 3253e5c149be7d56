"""The console scripts and what only they need: infinity-bench (``bench``), infinity-train (the
demo, ``demo``), infinity-export, infinity-generate and infinity-plan. Nothing else in
``infinity`` imports this package, and it imports nothing of the repository's ``tools/``
(benchmarks and development scripts, not packaged)."""
