"""What the store shows of itself: the timeline, its trace export, stats and audits."""
