"""Weights stored quantized for inference (``precision.storage_dtype`` ``int8`` or ``int4``).

A store attached without an optimizer reads every weight once per forward, so a forward costs
the weights' bytes on disk. Quantized, a weight matrix is stored once (at attach, or by
``load_pretrained``) in fewer bytes, on NVMe and in the host tier alike, and decoded into the
compute dtype on its way into the device copy: the weight's only full-size pass.

A weight is viewed as a matrix: its first dimension the output channels (rows), the rest
flattened into the input dimension (a Linear's ``[out, in]``, an Embedding's ``[vocab, dim]``, a
convolution's ``[out, in * kh * kw]``). It is cut into *units* that never cross a row and that a
shard never cuts (``Shard.quant``), each with its own scale:

* ``int8``: symmetric, one unit per row (per output channel). ``scale = max|w| / 127`` and
  ``code = round(w / scale)`` in -127..127, so ``w ~ code * scale``. Weights of a row are
  roughly centred on zero, and symmetric codes need no offset: decoding is a copy and a
  multiply. 1 byte per element plus a 4-byte scale per row.
* ``int4``: asymmetric, one unit per group of ``precision.quant_group_size`` elements along the
  input dimension (the group size must divide it). ``scale = (max - min) / 15``, ``code =
  round((w - min) / scale)`` in 0..15, so ``w ~ code * scale + min``. With only 16 levels the
  range matters more than the offset costs: a group whose values are not centred on zero would
  leave up to half of a symmetric code's levels unused. Two codes per byte (the even element
  in the low nibble), plus a 4-byte scale and a 4-byte minimum per group (1/16 byte per element
  at 128).

The stored bytes of a run of whole units are the units' scales (fp32), for int4 their minimums
(fp32), then the codes, so the float parts start 4-byte aligned where the shard's host copy
starts. Rounding an element to its nearest level leaves an error of at most half a scale.

Nothing can update a weight stored this way: attach refuses an optimizer, and backward through
one reaches the inputs (and the unquantized parameters) while its own gradient is dropped, with
one warning (``infinity.training.gradients``).

Decoding writes the compute-dtype values straight into the destination (a range of the device
copy): the codes are converted into it, then scaled (and offset) in place, in the destination's
dtype. The same function gives the reference values a test compares against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from infinity.errors import CheckpointError, ConfigError

#: ``precision.storage_dtype`` values that store weights quantized
QUANTIZED_STORAGE = ("int8", "int4")
#: weights with fewer elements stay in their dtype: their scales would cost more than the codes
#: save, and they are read in a moment anyway
MIN_QUANTIZED_NUMEL = 1024
_INT8_TOP = 127
_INT4_TOP = 15


@dataclass(frozen=True)
class WeightQuantizer:
    """How one weight's elements are stored: ``kind`` (``int8``/``int4``) in units of ``unit``
    elements, each with its own scale (see the module docstring)."""

    kind: str
    #: elements per unit: a row for int8, a group for int4
    unit: int

    @property
    def float_parts(self) -> int:
        """fp32 numbers stored per unit: the scale, and for int4 the minimum."""
        return 2 if self.kind == "int4" else 1

    def units(self, numel: int) -> int:
        assert numel % self.unit == 0, f"{numel} elements are not whole units of {self.unit}"
        return numel // self.unit

    def code_bytes(self, numel: int) -> int:
        return numel // 2 if self.kind == "int4" else numel

    def stored_bytes(self, numel: int) -> int:
        """Bytes that ``numel`` elements (whole units) are stored in."""
        return 4 * self.float_parts * self.units(numel) + self.code_bytes(numel)

    def parts(
        self, stored: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(scales, minimums or None, codes) of ``numel`` elements' stored bytes (uint8)."""
        units = self.units(numel)
        scales = stored[: 4 * units].view(torch.float32)
        minimums = None
        head = 4 * units
        if self.kind == "int4":
            minimums = stored[head : head + 4 * units].view(torch.float32)
            head += 4 * units
        return scales, minimums, stored[head : head + self.code_bytes(numel)]

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Stores ``values`` (flat, whole units, any float dtype) into ``out`` (uint8, exactly
        ``stored_bytes`` long)."""
        numel = values.numel()
        scales, minimums, codes = self.parts(out, numel)
        groups = values.detach().reshape(self.units(numel), self.unit).to(torch.float32)
        if self.kind == "int8":
            scale = groups.abs().amax(dim=1) / _INT8_TOP
            level = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
            codes.view(torch.int8).copy_(level.clamp_(-_INT8_TOP, _INT8_TOP).reshape(-1))
            scales.copy_(scale)
            return
        assert minimums is not None  # int4
        low = groups.amin(dim=1)
        scale = (groups.amax(dim=1) - low) / _INT4_TOP
        level = torch.round((groups - low[:, None]) / scale.clamp_min(1e-30)[:, None])
        level = level.clamp_(0, _INT4_TOP).to(torch.uint8).reshape(-1, 2)
        codes.copy_(level[:, 0] | (level[:, 1] << 4))
        scales.copy_(scale)
        minimums.copy_(low)

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """Writes the values ``stored`` (uint8, on ``out``'s device) holds into ``out`` (flat,
        contiguous, the compute dtype): the codes converted into it, then scaled (and offset)
        in place."""
        numel = out.numel()
        scales, minimums, codes = self.parts(stored, numel)
        groups = out.view(self.units(numel), self.unit)
        if self.kind == "int8":
            groups.copy_(codes.view(torch.int8).view(groups.shape))
            groups.mul_(scales[:, None])
            return
        assert minimums is not None  # int4
        # Each nibble converted straight into its place (the even elements, then the odd):
        # no interleaved uint8 copy in between, 30% less time than stacking them first.
        pairs = out.view(-1, 2)
        pairs[:, 0].copy_(codes & 15)
        pairs[:, 1].copy_(codes >> 4)
        groups.mul_(scales[:, None]).add_(minimums[:, None])

    def round_trip(self, values: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``values`` as they come back from being stored: what a stored weight computes with
        (in ``dtype``, default the values')."""
        flat = values.detach().reshape(-1)
        stored = torch.empty(self.stored_bytes(flat.numel()), dtype=torch.uint8)
        self.encode(flat, stored)
        out = torch.empty(flat.numel(), dtype=dtype or values.dtype)
        self.decode(stored, out)
        return out.view(values.shape)


@dataclass(frozen=True)
class WeightQuantization:
    """Which of a model's parameters are stored quantized, and how (``precision.storage_dtype``
    ``int8``/``int4``, ``precision.quant_group_size``)."""

    kind: str
    group_size: int = 128

    def quantizer_for(self, name: str, param: nn.Parameter) -> WeightQuantizer | None:
        """The quantizer of parameter ``name``, or None where it stays in its dtype (not a
        float weight of 2 or more dimensions and at least ``MIN_QUANTIZED_NUMEL`` elements).
        Raises ConfigError for an int4 weight whose input dimension the group size does not
        divide."""
        if not param.is_floating_point() or param.dim() < 2 or param.numel() < MIN_QUANTIZED_NUMEL:
            return None
        row = param.numel() // param.shape[0]
        if self.kind == "int8":
            return WeightQuantizer("int8", row)
        if row % self.group_size:
            divisors = [g for g in (256, 128, 64, 32, 16, 8, 4, 2) if row % g == 0]
            raise ConfigError(
                f"precision.quant_group_size={self.group_size} does not divide the input "
                f"dimension ({row}) of weight '{name}' {tuple(param.shape)}: int4 groups lie "
                f"along a row. Set precision.quant_group_size to a divisor of {row}"
                + (f" (e.g. {divisors[0]})" if divisors else "")
                + ", or use storage_dtype 'int8'"
            )
        return WeightQuantizer("int4", self.group_size)

    @classmethod
    def from_precision(cls, storage_dtype: str, group_size: int) -> WeightQuantization | None:
        """The quantization ``precision.storage_dtype`` asks for; None for a float dtype."""
        if storage_dtype not in QUANTIZED_STORAGE:
            return None
        return cls(storage_dtype, group_size)

    def check_checkpoint(self, what: str) -> None:
        """Refuses ``what`` (``save_checkpoint``, ``load_checkpoint``): checkpoints hold
        training state, and quantized weights are for inference."""
        raise CheckpointError(
            f"{what}() saves and restores training state, and weights stored quantized "
            f"(precision.storage_dtype={self.kind!r}) are for inference: "
            f"load them with load_pretrained() or load_state_dict(); model.state_dict() "
            f"gives their decoded values"
        )

    def check_attach(
        self, *, training: bool, offload_param: str, partitioned: bool, slot_bytes: int
    ) -> None:
        """Refuses, before anything moves, an attach that quantized storage cannot serve."""
        name = f"precision.storage_dtype={self.kind!r}"
        if training:
            # The optimizer would update values that are stored rounded to 16 or 256 levels:
            # an update smaller than half a level would be lost, and the fp32 masters that
            # could keep it are what quantized storage exists to avoid reading.
            raise ConfigError(
                f"{name} stores the weights quantized for inference, and an optimizer cannot "
                f"update quantized weights: attach the model without an optimizer (inference), "
                f"or train with storage_dtype 'auto' or 'bf16' (compute copies beside fp32 "
                f"masters)",
                field="precision.storage_dtype",
            )
        if offload_param == "none":
            raise ConfigError(
                f"{name} stores the weights quantized in the host tier or on NVMe, but "
                f"offload_param='none' keeps them on the device as they are: set offload_param "
                f"to 'cpu' or 'nvme', or leave storage_dtype 'auto'",
                field="precision.storage_dtype",
            )
        if partitioned:
            raise ConfigError(
                f"{name} is for one process: across data-parallel ranks each rank holds a slice "
                f"of a weight, which need not be whole rows or groups. Run inference in one "
                f"process per model, or leave storage_dtype 'auto'",
                field="precision.storage_dtype",
            )
        unit = self.group_size if self.kind == "int4" else None
        if unit is not None and WeightQuantizer("int4", unit).stored_bytes(unit) > slot_bytes:
            raise ConfigError(
                f"{name}: one group of {unit} elements does not fit in a buffer of {slot_bytes} "
                f"bytes: raise buffer_size or lower precision.quant_group_size",
                field="buffer_size",
            )

    def quantizer_in_slot(
        self, name: str, param: nn.Parameter, slot_bytes: int
    ) -> WeightQuantizer | None:
        """``quantizer_for``, refusing a weight whose unit (an int8 row) would not fit in one
        buffer (a shard never cuts a unit)."""
        quant = self.quantizer_for(name, param)
        if quant is not None and quant.stored_bytes(quant.unit) > slot_bytes:
            raise ConfigError(
                f"precision.storage_dtype={self.kind!r}: a row of weight '{name}' "
                f"{tuple(param.shape)} is stored in {quant.stored_bytes(quant.unit)} bytes, more "
                f"than a buffer ({slot_bytes} bytes), and a row is never cut: raise buffer_size"
                + (" or use storage_dtype 'int4'" if self.kind == "int8" else ""),
                field="buffer_size",
            )
        return quant
