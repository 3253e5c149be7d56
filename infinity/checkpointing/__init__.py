"""Checkpoints and weights in and out: DCP save and load, async saves, export, pretrained weights,
state dicts."""
