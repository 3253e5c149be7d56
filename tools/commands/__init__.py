"""The user-facing commands: infinity-bench, infinity-train (the demo), infinity-export,
infinity-generate, infinity-plan."""
