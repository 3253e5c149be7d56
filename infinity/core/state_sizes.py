"""Bytes of optimizer state as stored between steps (``precision.optimizer_state_dtype``): the
budgets size the tiers by them before any codec exists (the codecs are
:mod:`infinity.training.state_codecs`)."""

#: elements per int8 block (one fp32 scale each)
INT8_BLOCK = 2048


def stored_nbytes(name: str, numel: int) -> int:
    """Bytes of one fp32 state tensor of ``numel`` elements stored as ``name``
    (``precision.optimizer_state_dtype``)."""
    if name == "int8":
        return numel + 4 * -(-numel // INT8_BLOCK)
    return numel * {"fp32": 4, "bf16": 2}[name]
