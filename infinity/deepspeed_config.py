"""Reads a DeepSpeed config into an :class:`~infinity.config.OffloadConfig`.

The goal is that an existing ZeRO-Offload / ZeRO-Infinity config works unchanged, and that every
key either means something here or is reported once as accepted-but-unused. Typos are errors:
inside ``zero_optimization``, ``offload_param``, ``offload_optimizer``, ``aio``, ``fp16`` and
``bf16``, and at the top level unless the key belongs to another DeepSpeed feature (optimizer,
scheduler, monitoring, ...), which is ignored with one log line.

Mapping notes that change numbers:

* DeepSpeed counts ``offload_param.buffer_size``, ``offload_param.max_in_cpu``,
  ``reduce_bucket_size``, ``allgather_bucket_size`` and ``stage3_prefetch_bucket_size`` in
  *elements*; infinity counts bytes. Plain numbers are converted at the working dtype's size
  (2 bytes for fp16/bf16, 4 for fp32) and the conversion is logged; a string with a unit
  (``"256MiB"``) is taken as bytes as written.
* ``stage3_prefetch_bucket_size`` bounds both what is read from NVMe ahead (``prefetch_bytes``)
  and, across ranks, the all-gathers started ahead (``prefetch_bucket_size``).
* ``offload_param`` only exists at stage 3, as in DeepSpeed; below that params stay on the device.
* Keys a config leaves out take infinity's defaults, not DeepSpeed's.
* ``"auto"`` (Hugging Face Trainer placeholders) leaves the setting at infinity's default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infinity.config import (
    DTYPE_BYTES,
    OFFLOAD_TARGETS,
    AioConfig,
    BatchConfig,
    OffloadConfig,
    PrecisionConfig,
    check_keys,
    format_size,
    load_json,
)
from infinity.config_rules import normalise_paths, parse_size_parts
from infinity.errors import ConfigError

log = logging.getLogger("infinity.config")

_MAPPED_TOP = (
    "zero_optimization",
    "aio",
    "fp16",
    "bf16",
    "bfloat16",
    "gradient_clipping",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
# Other DeepSpeed features: valid in a DeepSpeed config, nothing to do with offloading.
_OTHER_TOP = (
    "optimizer",
    "scheduler",
    "wall_clock_breakdown",
    "memory_breakdown",
    "steps_per_print",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "sparse_attention",
    "disable_allgather",
    "dump_state",
    "amp",
    "autotuning",
    "elasticity",
    "checkpoint",
    "data_types",
    "pipeline",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "weight_quantization",
    "hybrid_engine",
    "dataloader_drop_last",
    "torch_autocast",
    "compile",
    "nebula",
    "graph_harvesting",
    "timers",
    "vocabulary_size",
    "use_data_before_expert_parallelism",
    "tensor_parallel",
    "sequence_parallel_size",
    "zenflow",
)
TOP_LEVEL_KEYS = frozenset(_MAPPED_TOP + _OTHER_TOP)

_ZERO_MAPPED = (
    "stage",
    "offload_param",
    "offload_optimizer",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "overlap_comm",
    "reduce_bucket_size",
    "allgather_bucket_size",
)
# Communication settings with a fixed answer here: what each would mean, why it does not.
_ZERO_COMM_FIXED = {
    "contiguous_gradients": "gradients always go into one contiguous slice per shard",
    "reduce_scatter": "gradients are reduce-scattered at stages 2 and 3 and all-reduced at "
    "stage 1, whatever this says",
    "allgather_partitions": "parameters are always assembled with all-gathers",
}
# Accepted, with what they mean in DeepSpeed and why they do nothing here.
_ZERO_NOT_USED = {
    "stage3_max_live_parameters": "DeepSpeed's cap on parameter elements resident on the GPU; "
    "here device_budget bounds device memory",
    "stage3_max_reuse_distance": "DeepSpeed keeps a parameter that is reused within this many "
    "elements; here reshard_after_forward decides which modules keep theirs for backward",
    "sub_group_size": "DeepSpeed's tile size for the optimizer step; not used",
    "stage3_model_persistence_threshold": "DeepSpeed's cap on the total size of persistent "
    "params; here param_persistence_threshold alone decides",
}
# Multi-GPU communication, partitioning and checkpoint-gathering switches.
_ZERO_DISTRIBUTED = (
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "use_multi_rank_bucket_allreduce",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_module_granularity_threshold",
    "stage3_allgather_sequential",
    "stage3_partition_stream_chunk_size",
    "zenflow",
    "leaf_module",
    "save_muon_momentum_buffer_in_memory",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)
_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "pin_memory", "max_in_cpu")
_OPTIMIZER_MAPPED = ("device", "nvme_path", "pin_memory", "buffer_count")
_OPTIMIZER_NOT_USED = (
    "fast_init",
    "ratio",
    "pipeline_read",
    "pipeline_write",
    "pipeline",
    "super_offload",
    "convert_grad_on_cpu",
    "cpuadam_cores_perc",
)
_AIO_MAPPED = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count")
_AIO_NOT_APPLICABLE = ("single_submit", "overlap_events", "use_gds")
_FP16_MAPPED = (
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)
_FP16_NOT_USED = (
    "auto_cast",
    "consecutive_hysteresis",
    "fp16_master_weights_and_grads",
    "fused_mode",
)
_BF16_NOT_USED = (
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)

_NATIVE_KEYS = frozenset(f for f in OffloadConfig.__dataclass_fields__) - TOP_LEVEL_KEYS
_ABSENT = object()


class _Mapper:
    """Collects OffloadConfig arguments, where each came from, and what to log."""

    def __init__(self) -> None:
        self.top: dict[str, Any] = {}
        self.sections: dict[str, dict[str, Any]] = {"aio": {}, "precision": {}, "batch": {}}
        self.origin: dict[str, str] = {}  # our dotted field -> DeepSpeed key path
        self.elements: list[tuple[str, str, Any]] = []  # (our field, DeepSpeed path, raw value)
        self.auto: list[str] = []
        self.notes: list[str] = []

    def get(self, section: Mapping[str, Any], key: str, path: str) -> Any:
        if key not in section:
            return _ABSENT
        value = section[key]
        if isinstance(value, str) and value == "auto":
            self.auto.append(path)
            return _ABSENT
        return value

    def put(self, ours: str, value: Any, path: str) -> None:
        if value is _ABSENT:
            return
        section, _, name = ours.rpartition(".")
        (self.sections[section] if section else self.top)[name] = value
        self.origin[ours] = path

    def take(self, section: Mapping[str, Any], key: str, ours: str, prefix: str) -> Any:
        path = f"{prefix}.{key}" if prefix else key
        value = self.get(section, key, path)
        self.put(ours, value, path)
        return value


def _section(parent: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path} must be a JSON object ({{...}}), got {value!r}", field=path)
    return value


def _expect(value: Any, path: str, kind: type, expected: str) -> Any:
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ConfigError(f"{path}={value!r} is invalid: expected {expected}", field=path)
    return value


def _device(section: Mapping[str, Any], m: _Mapper, path: str) -> str:
    value = m.get(section, "device", f"{path}.device")
    if value is _ABSENT:
        return "none"
    if value not in OFFLOAD_TARGETS:
        allowed = ", ".join(repr(t) for t in OFFLOAD_TARGETS)
        raise ConfigError(
            f"{path}.device={value!r} is invalid: expected one of {allowed}; use "
            "'none' (or remove the section) to keep this state on the device",
            field=f"{path}.device",
        )
    return value


def from_deepspeed(source: Mapping[str, Any] | str | os.PathLike[str]) -> OffloadConfig:
    """An OffloadConfig from a DeepSpeed config dict or the path of its JSON file."""
    data = load_json(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(data, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a dict or a path, not {type(data).__name__}")
    native = sorted(k for k in data if k in _NATIVE_KEYS)
    if native:
        raise ConfigError(
            f"{', '.join(map(repr, native))} "
            f"{'is an infinity key' if len(native) == 1 else 'are infinity keys'}, "
            "not a DeepSpeed one; in a DeepSpeed config put offload settings under "
            "zero_optimization.offload_param / offload_optimizer, or load a native config with "
            "OffloadConfig.from_file / from_dict",
            field=native[0],
        )
    check_keys(data, TOP_LEVEL_KEYS, "the DeepSpeed config")

    m = _Mapper()
    zero = _section(data, "zero_optimization", "zero_optimization")
    check_keys(
        zero,
        _ZERO_MAPPED + tuple(_ZERO_NOT_USED) + tuple(_ZERO_COMM_FIXED) + _ZERO_DISTRIBUTED,
        "zero_optimization",
    )
    param = _section(zero, "offload_param", "zero_optimization.offload_param")
    check_keys(param, _PARAM_KEYS, "offload_param")
    optim = _section(zero, "offload_optimizer", "zero_optimization.offload_optimizer")
    check_keys(optim, _OPTIMIZER_MAPPED + _OPTIMIZER_NOT_USED, "offload_optimizer")
    aio = _section(data, "aio", "aio")
    check_keys(aio, _AIO_MAPPED + _AIO_NOT_APPLICABLE, "aio")
    fp16 = _section(data, "fp16", "fp16")
    check_keys(fp16, _FP16_MAPPED + _FP16_NOT_USED, "fp16")
    if "bf16" in data and "bfloat16" in data:
        raise ConfigError(
            "both 'bf16' and its legacy name 'bfloat16' are set; keep only 'bf16'", field="bf16"
        )
    bf16_key = "bfloat16" if "bfloat16" in data else "bf16"
    bf16 = _section(data, bf16_key, bf16_key)
    check_keys(bf16, ("enabled",) + _BF16_NOT_USED, bf16_key)

    stage = m.get(zero, "stage", "zero_optimization.stage")
    stage = 0 if stage is _ABSENT else stage
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(
            f"zero_optimization.stage={stage!r} is invalid: expected an integer in "
            "0..3; use 3 to offload parameters, 1 or 2 for optimizer state only",
            field="zero_optimization.stage",
        )

    _map_precision(m, fp16, bf16, bf16_key)
    _map_offload(m, zero, param, optim, stage)
    # What is partitioned across ranks (no effect in one process). Stage 0 (plain data
    # parallel) becomes stage 1: the same results, the optimizer state partitioned.
    if "stage" in zero:
        m.put("zero_stage", max(stage, 1), "zero_optimization.stage")
    if stage == 0 and "stage" in zero:
        m.notes.append(
            "zero_optimization.stage=0 runs as zero_stage=1 across ranks (optimizer "
            "state partitioned, gradients all-reduced: the same results)"
        )
    m.take(zero, "overlap_comm", "overlap_comm", "zero_optimization")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        bucket = m.get(zero, key, f"zero_optimization.{key}")
        if bucket is not _ABSENT:
            m.elements.append((key, f"zero_optimization.{key}", bucket))
    _map_aio(m, aio)
    m.take(data, "gradient_clipping", "gradient_clipping", "")
    m.take(data, "train_batch_size", "batch.train_batch_size", "")
    m.take(data, "train_micro_batch_size_per_gpu", "batch.micro_batch_size", "")
    m.take(data, "gradient_accumulation_steps", "batch.gradient_accumulation_steps", "")

    ignored_zero = [k for k in zero if k in _ZERO_DISTRIBUTED]
    if stage < 3:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            if key in zero:
                ignored_zero.append(key)
    else:
        path = "zero_optimization.stage3_param_persistence_threshold"
        threshold = m.get(zero, "stage3_param_persistence_threshold", path)
        m.put(
            "param_persistence_threshold",
            _whole(threshold, path) if isinstance(threshold, float) else threshold,
            path,
        )
        value = m.get(
            zero, "stage3_prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"
        )
        if value is not _ABSENT:
            # DeepSpeed's bound on what is fetched ahead: here the NVMe reads ahead and, across
            # ranks, the all-gathers ahead.
            for ours in ("prefetch_bytes", "prefetch_bucket_size"):
                m.elements.append((ours, "zero_optimization.stage3_prefetch_bucket_size", value))
    _convert_elements(m)
    config = _construct(m)

    other = [k for k in data if k in _OTHER_TOP]
    if other:
        log.info("DeepSpeed keys for features other than offloading, ignored: %s", ", ".join(other))
    if ignored_zero:
        log.info(
            "zero_optimization keys for DeepSpeed features this runtime does not have, ignored: %s",
            ", ".join(ignored_zero),
        )
    fixed = [f"{k} ({_ZERO_COMM_FIXED[k]})" for k in zero if k in _ZERO_COMM_FIXED]
    if fixed:
        log.info(
            "zero_optimization communication keys with a fixed answer here: %s", "; ".join(fixed)
        )
    not_used = [f"{k} ({_ZERO_NOT_USED[k]})" for k in zero if k in _ZERO_NOT_USED]
    if not_used:
        log.info("zero_optimization keys accepted but not used: %s", "; ".join(not_used))
    for note in m.notes:
        log.info("%s", note)
    if m.auto:
        log.info(
            "'auto' values (Hugging Face Trainer placeholders) left at infinity's defaults: %s",
            ", ".join(m.auto),
        )
    log.info(
        "DeepSpeed config mapped: ZeRO stage %d, offload_param=%s, offload_optimizer=%s, dtype=%s",
        stage,
        config.offload_param,
        config.offload_optimizer,
        config.precision.dtype,
    )
    return config


def _map_precision(
    m: _Mapper, fp16: Mapping[str, Any], bf16: Mapping[str, Any], bf16_key: str
) -> None:
    fp16_on = m.get(fp16, "enabled", "fp16.enabled")
    bf16_on = m.get(bf16, "enabled", f"{bf16_key}.enabled")
    fp16_on = fp16_on is not _ABSENT and _expect(fp16_on, "fp16.enabled", bool, "true or false")
    bf16_on = bf16_on is not _ABSENT and _expect(
        bf16_on, f"{bf16_key}.enabled", bool, "true or false"
    )
    if fp16_on and bf16_on:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true: enable at most one "
            "(bf16 needs no loss scaling; fp16 uses the fp16 loss-scale keys)",
            field="precision.dtype",
        )
    if fp16_on or bf16_on:
        m.put(
            "precision.dtype",
            "fp16" if fp16_on else "bf16",
            "fp16.enabled" if fp16_on else f"{bf16_key}.enabled",
        )
    for key in _FP16_MAPPED[1:]:
        m.take(fp16, key, f"precision.{key}", "fp16")
    unused = [k for k in fp16 if k in _FP16_NOT_USED] + [k for k in bf16 if k in _BF16_NOT_USED]
    if unused:
        m.notes.append(
            f"fp16/bf16 keys accepted but not used (infinity keeps fp32 master "
            f"weights with the optimizer state): {', '.join(unused)}"
        )


def _map_offload(
    m: _Mapper,
    zero: Mapping[str, Any],
    param: Mapping[str, Any],
    optim: Mapping[str, Any],
    stage: int,
) -> None:
    param_device = _device(param, m, "zero_optimization.offload_param")
    optim_device = _device(optim, m, "zero_optimization.offload_optimizer")
    legacy = [
        k for k in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory") if k in zero
    ]
    for key in legacy:
        _expect(zero[key], f"zero_optimization.{key}", bool, "true or false")
    if legacy:
        m.notes.append(
            f"deprecated DeepSpeed keys {', '.join(legacy)} mapped; prefer "
            "offload_param / offload_optimizer sections"
        )
    if zero.get("cpu_offload") and optim_device == "none" and "device" not in optim:
        optim_device = "cpu"
    if zero.get("cpu_offload_param") and param_device == "none" and "device" not in param:
        param_device = "cpu"

    if stage < 3 and param_device != "none":
        m.notes.append(
            f"zero_optimization.offload_param (device={param_device!r}) is not used at "
            f"ZeRO stage {stage}: DeepSpeed ignores offload_param below stage 3 too, so "
            "parameters stay on the device (offload_param='none')"
        )
        param_device = "none"
    m.put("offload_param", param_device, "zero_optimization.offload_param.device")
    m.put("offload_optimizer", optim_device, "zero_optimization.offload_optimizer.device")

    paths: list[Path] = []
    pins: dict[str, bool] = {}  # DeepSpeed key path -> value
    counts: dict[str, int] = {}
    for name, section, device in (
        ("offload_param", param, param_device),
        ("offload_optimizer", optim, optim_device),
    ):
        path = f"zero_optimization.{name}"
        if device == "none":
            continue
        raw = m.get(section, "nvme_path", f"{path}.nvme_path")
        if raw is not _ABSENT and raw is not None:
            if device == "nvme":
                paths += [p for p in normalise_paths(f"{path}.nvme_path", raw) if p not in paths]
                m.origin["nvme_path"] = f"{path}.nvme_path"
            else:
                m.notes.append(f"{path}.nvme_path is ignored because {name} goes to {device!r}")
        pin = m.get(section, "pin_memory", f"{path}.pin_memory")
        if pin is not _ABSENT:
            pins[f"{path}.pin_memory"] = _expect(pin, f"{path}.pin_memory", bool, "true or false")
        count = m.get(section, "buffer_count", f"{path}.buffer_count")
        if count is not _ABSENT and (name == "offload_param" or device == "nvme"):
            counts[name] = _expect(count, f"{path}.buffer_count", int, "an integer >= 1")
        if name == "offload_param":
            for key in ("buffer_size", "max_in_cpu"):
                value = m.get(section, key, f"{path}.{key}")
                if value is not _ABSENT:
                    m.elements.append((key, f"{path}.{key}", value))
    if zero.get("cpu_offload_use_pin_memory") is not None and not pins:
        pins["zero_optimization.cpu_offload_use_pin_memory"] = zero["cpu_offload_use_pin_memory"]
    if paths:
        m.top["nvme_path"] = tuple(paths)
    if pins:
        source = next(iter(pins))  # offload_param's when it has one: params are the hot path
        if len(set(pins.values())) > 1:
            m.notes.append(
                f"offload_param and offload_optimizer disagree on pin_memory; using "
                f"{source}={pins[source]} for the shared swap buffers"
            )
        m.put("pin_memory", pins[source], source)
    if counts:
        owner = max(counts, key=counts.__getitem__)
        if len(set(counts.values())) > 1:
            m.notes.append(
                f"buffer_count differs between offload sections {counts}; the shared "
                f"swap buffer pool uses the larger, {counts[owner]}"
            )
        m.put("buffer_count", counts[owner], f"zero_optimization.{owner}.buffer_count")

    present = [k for k in optim if k in _OPTIMIZER_NOT_USED]
    if present:
        details = ", ".join(f"{k}={optim[k]!r}" for k in present)
        m.notes.append(
            f"offload_optimizer keys with no meaning here, ignored: {details} "
            "(infinity overlaps optimizer-state I/O with compute on its own and "
            "offloads all optimizer state)"
        )


def _map_aio(m: _Mapper, aio: Mapping[str, Any]) -> None:
    block = m.get(aio, "block_size", "aio.block_size")
    if block is not _ABSENT:
        m.put(
            "aio.block_size",
            parse_size_parts(block, "aio.block_size")[0]
            if isinstance(block, (str, float))
            else block,
            "aio.block_size",
        )
    m.take(aio, "queue_depth", "aio.queue_depth", "aio")
    threads = {k: m.get(aio, k, f"aio.{k}") for k in ("intra_op_parallelism", "thread_count")}
    given = {k: v for k, v in threads.items() if v is not _ABSENT}
    if len(given) == 2 and given["intra_op_parallelism"] != given["thread_count"]:
        raise ConfigError(
            f"aio.intra_op_parallelism={given['intra_op_parallelism']!r} and its "
            f"legacy name aio.thread_count={given['thread_count']!r} disagree; keep "
            "only intra_op_parallelism",
            field="aio.thread_count",
        )
    for key, value in given.items():
        m.put("aio.thread_count", value, f"aio.{key}")
    present = [k for k in aio if k in _AIO_NOT_APPLICABLE]
    if present:
        m.notes.append(
            f"aio keys not applicable to infinity's I/O engine, ignored: "
            f"{', '.join(present)} (GPUDirect Storage is not used; data moves through "
            "the pinned host swap buffers)"
        )


def _whole(value: Any, path: str) -> Any:
    """Integral floats (``1e5``, common in DeepSpeed JSON) as ints; others left for validation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{path}={value!r} is invalid: expected a whole number", field=path)


def _convert_elements(m: _Mapper) -> None:
    dtype = m.sections["precision"].get("dtype", "fp32")
    itemsize = DTYPE_BYTES[dtype]
    converted = []
    for ours, path, raw in m.elements:
        amount, has_unit = parse_size_parts(raw, path)
        nbytes = amount if has_unit else amount * itemsize
        if not has_unit:
            converted.append(f"{path} {amount} -> {ours} {nbytes} ({format_size(nbytes)})")
        m.put(ours, nbytes, path)
    if converted:
        m.notes.append(
            f"DeepSpeed counts these in elements; converted to bytes at {itemsize} "
            f"bytes/element ({dtype}): {', '.join(converted)}"
        )


def _construct(m: _Mapper) -> OffloadConfig:
    try:
        return OffloadConfig(
            aio=AioConfig(**m.sections["aio"]),
            precision=PrecisionConfig(**m.sections["precision"]),
            batch=BatchConfig(**m.sections["batch"]),
            **m.top,
        )
    except ConfigError as exc:
        origin = m.origin.get(exc.field or "")
        if origin is None or origin == exc.field:
            raise
        raise ConfigError(f"{exc} (set by DeepSpeed key {origin!r})", field=exc.field) from exc


def mapped_keys() -> tuple[str, ...]:
    """Every DeepSpeed key path this mapping turns into a setting (the docs' reference is
    generated from it)."""
    zero = "zero_optimization"
    sections = ("zero_optimization", "aio", "fp16", "bf16", "bfloat16")
    return (
        tuple(k for k in _MAPPED_TOP if k not in sections)
        + tuple(f"{zero}.{k}" for k in _ZERO_MAPPED if not k.startswith("offload_"))
        + tuple(f"{zero}.offload_param.{k}" for k in _PARAM_KEYS)
        + tuple(f"{zero}.offload_optimizer.{k}" for k in _OPTIMIZER_MAPPED)
        + tuple(f"aio.{k}" for k in _AIO_MAPPED)
        + tuple(f"fp16.{k}" for k in _FP16_MAPPED)
        + ("bf16.enabled", "bfloat16.enabled")
    )


def unused_keys() -> dict[str, dict[str, str]]:
    """The DeepSpeed keys accepted without effect, by group: {group: {key path: why}}."""
    zero = "zero_optimization"
    distributed = "a DeepSpeed multi-GPU feature this runtime does not have; ignored"
    below_stage3 = "used at stage 3 only (DeepSpeed ignores it below too)"
    return {
        "zero_optimization": {
            **{f"{zero}.{k}": why for k, why in _ZERO_NOT_USED.items()},
            **{f"{zero}.{k}": f"fixed here: {why}" for k, why in _ZERO_COMM_FIXED.items()},
            **{f"{zero}.{k}": distributed for k in _ZERO_DISTRIBUTED},
            f"{zero}.stage3_prefetch_bucket_size (stage < 3)": below_stage3,
            f"{zero}.stage3_param_persistence_threshold (stage < 3)": below_stage3,
        },
        "offload_optimizer": {
            f"{zero}.offload_optimizer.{k}": "infinity overlaps optimizer-state I/O with "
            "compute on its own and offloads all optimizer state"
            for k in _OPTIMIZER_NOT_USED
        },
        "aio": {
            f"aio.{k}": "not applicable: GPUDirect Storage is not used; data moves through "
            "the pinned host swap buffers"
            for k in _AIO_NOT_APPLICABLE
        },
        "fp16 and bf16": {
            **{
                f"fp16.{k}": "infinity keeps fp32 masters with the optimizer state"
                for k in _FP16_NOT_USED
            },
            **{
                f"bf16.{k}": "infinity keeps fp32 masters with the optimizer state"
                for k in _BF16_NOT_USED
            },
        },
        "top level": {k: "another DeepSpeed feature, not offloading; ignored" for k in _OTHER_TOP},
    }


class _DeepSpeedFormat:
    """This module as the config's reader of DeepSpeed configs (``config.ForeignFormat``)."""

    top_level_keys = TOP_LEVEL_KEYS

    def read(self, source: Mapping[str, Any] | str | os.PathLike[str]) -> OffloadConfig:
        return from_deepspeed(source)


#: handed to infinity.config by the package (``read_deepspeed_with``)
DEEPSPEED = _DeepSpeedFormat()
