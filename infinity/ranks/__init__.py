"""Data-parallel ranks: how the training state is partitioned across them (ZeRO stages 1-3)."""
