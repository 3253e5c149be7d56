"""Tests for infinity.config and the DeepSpeed mapping in infinity.deepspeed_config."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinity.config import (
    AioConfig,
    BatchConfig,
    OffloadConfig,
    PrecisionConfig,
    format_size,
    parse_size,
)
from infinity.errors import ConfigError, InfinityError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "configs"
PROFILER_NATIVE = {
    "aio": {"backend": "uring", "block_size": 1048576, "queue_depth": 8, "thread_count": None},
    "buffer_count": 5,
    "buffer_size": 67108864,
}


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "infinity.config"]


def only_one(caplog: pytest.LogCaptureFixture, text: str) -> str:
    hits = [m for m in messages(caplog) if text in m]
    assert len(hits) == 1, (text, messages(caplog))
    return hits[0]


# --------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    c = OffloadConfig()
    assert (c.device, c.offload_param, c.offload_optimizer) == ("auto", "nvme", "none")
    assert c.nvme_path == ()
    assert (c.buffer_count, c.buffer_size, c.pin_memory) == (5, None, True)
    assert c.swap_buffer_size() == 64 << 20  # derived: 64 MiB without a host budget
    assert c.replace(host_budget=1 << 30).swap_buffer_size() == 16 << 20  # a 64th of it
    assert c.replace(host_budget=64 << 20).swap_buffer_size() == 1 << 20  # at least 1 MiB
    assert c.restore_params == "auto"
    assert c.max_in_cpu == 0  # the swap buffers are the whole host footprint by default
    assert c.device_budget is None and c.host_budget is None and c.prefetch_bytes is None
    assert (c.prefetch_depth, c.param_persistence_threshold, c.gradient_clipping) == (2, 0, 0.0)
    assert c.keep_swap_files is False and c.verify_checksums is True
    assert c.aio == AioConfig("auto", 1 << 20, 8, None)
    assert c.precision == PrecisionConfig("fp32", 0.0, 16, 1000, 2, 1.0)
    assert c.batch == BatchConfig(None, None, 1)
    assert c.precision.itemsize == 4
    assert c.swap_buffer_bytes() == 5 * (64 << 20)


def test_error_classes() -> None:
    assert issubclass(ConfigError, InfinityError) and issubclass(ConfigError, ValueError)


def test_nested_defaults_are_distinct_objects_but_equal() -> None:
    a, b = OffloadConfig(), OffloadConfig()
    assert a == b and hash(a) == hash(b)


# --------------------------------------------------------------------------- validation matrix

BAD_TOP = [
    ("device", "gpu"),
    ("device", "cuda:x"),
    ("device", "cpu:0"),
    ("device", 0),
    ("offload_param", "disk"),
    ("offload_param", None),
    ("offload_param", "NVMe"),
    ("offload_optimizer", "gpu"),
    ("nvme_path", 5),
    ("nvme_path", [""]),
    ("nvme_path", ["/a", "/a"]),
    ("nvme_path", [1]),
    ("buffer_count", 0),
    ("buffer_count", -1),
    ("buffer_count", 2.0),
    ("buffer_count", True),
    ("buffer_count", "5"),
    ("buffer_size", 0),
    ("buffer_size", 4095),
    ("buffer_size", "64 apples"),
    ("buffer_size", 1.5),
    ("buffer_size", True),
    ("pin_memory", 1),
    ("pin_memory", "yes"),
    ("pin_memory", None),
    ("max_in_cpu", -1),
    ("max_in_cpu", 1.0),
    ("device_budget", 0),
    ("device_budget", -5),
    ("device_budget", [1]),
    ("host_budget", 0),
    ("host_budget", False),
    ("prefetch_depth", -1),
    ("prefetch_depth", 1.5),
    ("prefetch_bytes", -1),
    ("reduce_bucket_size", 0),
    ("allgather_bucket_size", 0),
    ("allgather_bucket_size", -1),
    ("prefetch_bucket_size", -1),
    ("param_persistence_threshold", -1),
    ("gradient_clipping", -0.1),
    ("gradient_clipping", math.nan),
    ("gradient_clipping", math.inf),
    ("gradient_clipping", "1"),
    ("gradient_clipping", True),
    ("keep_swap_files", 0),
    ("verify_checksums", "true"),
    ("aio", {"backend": "threads"}),
    ("precision", None),
    ("batch", PrecisionConfig()),
]
BAD_NESTED = [
    (AioConfig, "backend", "io_uring"),
    (AioConfig, "backend", ""),
    (AioConfig, "block_size", 0),
    (AioConfig, "block_size", 4095),
    (AioConfig, "block_size", 4097),
    (AioConfig, "block_size", 1_000_000),
    (AioConfig, "block_size", "4 kay"),
    (AioConfig, "queue_depth", 0),
    (AioConfig, "queue_depth", 1025),
    (AioConfig, "queue_depth", 8.0),
    (AioConfig, "thread_count", 0),
    (AioConfig, "thread_count", 1025),
    (AioConfig, "thread_count", True),
    (PrecisionConfig, "dtype", "float16"),
    (PrecisionConfig, "dtype", "fp64"),
    (PrecisionConfig, "loss_scale", -1.0),
    (PrecisionConfig, "loss_scale", math.inf),
    (PrecisionConfig, "initial_scale_power", -1),
    (PrecisionConfig, "initial_scale_power", 64),
    (PrecisionConfig, "loss_scale_window", 0),
    (PrecisionConfig, "hysteresis", 0),
    (PrecisionConfig, "min_loss_scale", 0),
    (PrecisionConfig, "min_loss_scale", -1.0),
    (BatchConfig, "train_batch_size", 0),
    (BatchConfig, "micro_batch_size", 0),
    (BatchConfig, "gradient_accumulation_steps", 0),
    (BatchConfig, "gradient_accumulation_steps", None),
]
SECTION = {AioConfig: "aio", PrecisionConfig: "precision", BatchConfig: "batch"}


def assert_names(exc: ConfigError, name: str, value: object) -> None:
    text = str(exc)
    assert exc.field == name
    assert text.startswith(f"{name}=")
    if not isinstance(value, (dict, PrecisionConfig)):
        assert repr(value) in text or repr(value).strip("'") in text
    assert "expected" in text  # the allowed values / range
    assert ";" in text  # followed by what to do


@pytest.mark.parametrize(("name", "value"), BAD_TOP)
def test_top_level_field_rejects(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**{name: value})
    assert_names(info.value, name, value)


@pytest.mark.parametrize(("cls", "name", "value"), BAD_NESTED)
def test_nested_field_rejects(cls: type, name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    assert_names(info.value, f"{SECTION[cls]}.{name}", value)


@pytest.mark.parametrize(("cls", "name", "value"), BAD_NESTED)
def test_nested_field_rejects_through_from_dict(cls: type, name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_dict({SECTION[cls]: {name: value}})
    assert info.value.field == f"{SECTION[cls]}.{name}"


def test_error_messages_say_what_to_do() -> None:
    with pytest.raises(ConfigError, match=r"buffer_count=0 .*>= 1; use 2 or more"):
        OffloadConfig(buffer_count=0)
    with pytest.raises(ConfigError, match="did you mean 'nvme'"):
        OffloadConfig(offload_param="NVMe")
    with pytest.raises(ConfigError, match="1MiB"):
        AioConfig(block_size=1_000_000)
    # Size strings read the same in Python as in JSON.
    assert OffloadConfig(buffer_size="64MiB").buffer_size == 64 << 20
    with pytest.raises(ConfigError, match="buffer_size"):
        OffloadConfig(buffer_size="64 apples")
    with pytest.raises(ConfigError, match="listed twice"):
        OffloadConfig(nvme_path=["/a", Path("/a")])


def test_buffer_count_one_is_allowed() -> None:
    assert OffloadConfig(buffer_count=1).buffer_count == 1


def test_batch_sizes_must_be_consistent() -> None:
    assert BatchConfig(32, 4, 8).train_batch_size == 32
    assert BatchConfig(64, 4, 8).train_batch_size == 64  # two data-parallel processes
    with pytest.raises(
        ConfigError, match="multiple of micro_batch_size x gradient_accumulation_steps = 32"
    ):
        BatchConfig(33, 4, 8)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_devices_accepted(device: str) -> None:
    assert OffloadConfig(device=device).device == device


def test_torch_device_accepted() -> None:
    torch = pytest.importorskip("torch")
    assert OffloadConfig(device=torch.device("cuda", 1)).device == "cuda:1"


def test_nvme_path_normalisation(tmp_path: Path) -> None:
    assert OffloadConfig(nvme_path="/mnt/a").nvme_path == (Path("/mnt/a"),)
    assert OffloadConfig(nvme_path=tmp_path).nvme_path == (tmp_path,)
    both = OffloadConfig(nvme_path=["/mnt/a", Path("/mnt/b")]).nvme_path
    assert both == (Path("/mnt/a"), Path("/mnt/b"))
    assert OffloadConfig(nvme_path=("/x",)).nvme_path == (Path("/x"),)
    assert OffloadConfig(nvme_path="~/swap").nvme_path == (Path.home() / "swap",)
    assert OffloadConfig(nvme_path=[]).nvme_path == ()


def test_floats_normalised() -> None:
    c = OffloadConfig(gradient_clipping=1, precision=PrecisionConfig(loss_scale=128))
    assert isinstance(c.gradient_clipping, float) and isinstance(c.precision.loss_scale, float)


# --------------------------------------------------------------------------- unknown keys


def test_unknown_native_keys_suggest() -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_dict({"buffer_cout": 5})
    assert str(info.value) == (
        "unknown key 'buffer_cout' in the infinity config; did you mean 'buffer_count'?"
    )
    with pytest.raises(
        ConfigError, match="unknown key 'queue_dept' in aio; did you mean 'queue_depth'\\?"
    ):
        OffloadConfig.from_dict({"aio": {"queue_dept": 8}})
    with pytest.raises(ConfigError, match="unknown key 'dtyp' in precision; did you mean 'dtype'"):
        OffloadConfig.from_dict({"precision": {"dtyp": "bf16"}})
    with pytest.raises(
        ConfigError, match="unknown key 'zzz' .*valid keys are: aio, allgather_bucket_size, batch"
    ):
        OffloadConfig.from_dict({"zzz": 1})


def test_from_dict_rejects_non_objects() -> None:
    with pytest.raises(ConfigError, match="must be a JSON object"):
        OffloadConfig.from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="aio must be a JSON object"):
        OffloadConfig.from_dict({"aio": "uring"})


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("2GiB", 2 << 30),
        ("512MB", 512 * 10**6),
        ("1.5G", 3 << 29),
        ("64 KiB", 65536),
        ("64k", 65536),
        ("1e3", 1000),
        (5e8, 500_000_000),
        ("0.5KiB", 512),
        ("1TiB", 1 << 40),
        ("3 gb", 3 * 10**9),
        ("100B", 100),
        (".5M", 1 << 19),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["1.5B", "-1G", "12XB", "abc", "", True, 0.5, math.nan, None, "1,5G"]
)
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="buffer_size="):
        parse_size(bad, name="buffer_size")  # type: ignore[arg-type]


def test_size_strings_in_from_dict() -> None:
    c = OffloadConfig.from_dict(
        {
            "buffer_size": "128MiB",
            "max_in_cpu": "2GiB",
            "device_budget": "1.5G",
            "host_budget": "512MB",
            "prefetch_bytes": 5e8,
            "aio": {"block_size": "512KiB"},
        }
    )
    assert c.buffer_size == 128 << 20 and c.max_in_cpu == 2 << 30
    assert c.device_budget == 3 << 29 and c.host_budget == 512_000_000
    assert c.prefetch_bytes == 500_000_000 and c.aio.block_size == 512 << 10


def test_size_strings_only_for_size_fields() -> None:
    with pytest.raises(ConfigError, match="buffer_count='5'"):
        OffloadConfig.from_dict({"buffer_count": "5"})
    with pytest.raises(ConfigError, match="aio.block_size=1000000 .*multiple of 4096"):
        OffloadConfig.from_dict({"aio": {"block_size": "1MB"}})
    with pytest.raises(ConfigError, match="max_in_cpu=True"):
        OffloadConfig.from_dict({"max_in_cpu": True})


def test_format_size() -> None:
    assert format_size(None) == "auto"
    assert format_size(100) == "100 B"
    assert format_size(64 << 20) == "64.0 MiB"


# --------------------------------------------------------------------------- round trip, frozen


def test_round_trip_defaults_and_custom() -> None:
    custom = OffloadConfig(
        device="cuda:1",
        offload_param="cpu",
        offload_optimizer="nvme",
        nvme_path=["/mnt/a", "/mnt/b"],
        buffer_count=8,
        buffer_size=1 << 27,
        pin_memory=False,
        max_in_cpu=0,
        device_budget=10 << 30,
        host_budget=64 << 30,
        prefetch_depth=0,
        prefetch_bytes=1 << 28,
        param_persistence_threshold=100_000,
        gradient_clipping=1.0,
        keep_swap_files=True,
        verify_checksums=False,
        aio=AioConfig("threads", 1 << 19, 32, 16),
        precision=PrecisionConfig("fp16", 0, 12, 500, 3, 0.5),
        batch=BatchConfig(64, 8, 4),
    )
    for config in (OffloadConfig(), custom):
        data = config.to_dict()
        text = json.dumps(data)  # JSON-serialisable, paths as strings
        assert OffloadConfig.from_dict(json.loads(text)) == config
    assert custom.to_dict()["nvme_path"] == ["/mnt/a", "/mnt/b"]
    assert custom.to_dict()["aio"] == {
        "backend": "threads",
        "block_size": 1 << 19,
        "queue_depth": 32,
        "thread_count": 16,
        "request_timeout": 60.0,
    }


@settings(max_examples=60, deadline=None)
@given(
    buffer_count=st.integers(1, 64),
    buffer_size=st.integers(4096, 1 << 34),
    queue_depth=st.integers(1, 1024),
    blocks=st.integers(1, 4096),
    paths=st.lists(st.sampled_from(["/a", "/b", "/c/d", "rel/x"]), unique=True, max_size=3),
    dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    clip=st.floats(0, 1e6, allow_nan=False),
    budget=st.none() | st.integers(1, 1 << 45),
)
def test_round_trip_property(
    buffer_count: int,
    buffer_size: int,
    queue_depth: int,
    blocks: int,
    paths: list[str],
    dtype: str,
    clip: float,
    budget: int | None,
) -> None:
    config = OffloadConfig(
        buffer_count=buffer_count,
        buffer_size=buffer_size,
        nvme_path=paths,
        gradient_clipping=clip,
        host_budget=budget,
        aio=AioConfig(queue_depth=queue_depth, block_size=blocks * 4096),
        precision=PrecisionConfig(dtype=dtype),
    )
    assert OffloadConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_frozen() -> None:
    c = OffloadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.buffer_count = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.aio.queue_depth = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.precision.dtype = "bf16"  # type: ignore[misc]


def test_replace() -> None:
    base = OffloadConfig(aio=AioConfig(backend="threads"))
    changed = base.replace(
        buffer_count=8, buffer_size="128MiB", nvme_path="/mnt/x", aio={"queue_depth": 16}
    )
    assert changed.buffer_count == 8 and changed.buffer_size == 128 << 20
    assert changed.nvme_path == (Path("/mnt/x"),)
    assert changed.aio == AioConfig(backend="threads", queue_depth=16)  # merged, not reset
    assert base.buffer_count == 5 and base.aio.queue_depth == 8  # original untouched
    assert base.replace(precision=PrecisionConfig("bf16")).precision.dtype == "bf16"
    with pytest.raises(ConfigError, match="buffer_count=0"):
        base.replace(buffer_count=0)
    with pytest.raises(ConfigError, match="aio.queue_depth=0"):
        base.replace(aio={"queue_depth": 0})
    with pytest.raises(
        ConfigError, match="unknown key 'bufer_size' in replace\\(\\); did you mean 'buffer_size'"
    ):
        base.replace(bufer_size=1)


def test_describe() -> None:
    text = OffloadConfig(
        nvme_path="/mnt/nvme", precision=PrecisionConfig("fp16"), offload_optimizer="cpu"
    ).describe()
    assert text.splitlines()[0] == "infinity offload config"
    assert "5 x 64.0 MiB = 320.0 MiB host RAM (pinned)" in text
    assert "/mnt/nvme" in text and "cpu (host RAM)" in text
    assert "dynamic loss scale from 2**16" in text
    plain = OffloadConfig(offload_param="none").describe()
    assert "swap buffers" not in plain and "nvme_path" not in plain
    assert "a private temporary directory" in OffloadConfig().describe()


# --------------------------------------------------------------------------- files


def test_profiler_native_format() -> None:
    c = OffloadConfig.from_dict(PROFILER_NATIVE)
    assert c.aio == AioConfig(backend="uring", block_size=1 << 20, queue_depth=8, thread_count=None)
    assert (c.buffer_count, c.buffer_size) == (5, 64 << 20)
    assert c.replace(aio=AioConfig(backend="uring")) == c  # everything else is default


def test_from_file_native(tmp_path: Path) -> None:
    path = tmp_path / "bandwidth.json"
    path.write_text(json.dumps(PROFILER_NATIVE))
    assert OffloadConfig.from_file(path) == OffloadConfig.from_dict(PROFILER_NATIVE)
    assert OffloadConfig.from_file(str(path)).aio.backend == "uring"
    written = tmp_path / "roundtrip.json"
    custom = OffloadConfig(nvme_path="/mnt/a", precision=PrecisionConfig("bf16"))
    written.write_text(json.dumps(custom.to_dict()))
    assert OffloadConfig.from_file(written) == custom


def test_from_file_deepspeed(tmp_path: Path) -> None:
    c = OffloadConfig.from_file(EXAMPLES / "seed_zero3_nvme.json")
    assert c == OffloadConfig.from_deepspeed(EXAMPLES / "seed_zero3_nvme.json")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 0.5}))
    loaded = OffloadConfig.from_file(path)
    assert loaded.batch.train_batch_size == 8 and loaded.offload_param == "none"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read config file"),
        ("{not json", "not valid JSON: .* line 1"),
        ("[1, 2]", "must hold a JSON object"),
    ],
)
def test_from_file_errors(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_file(path)


def test_from_file_mixed_formats(tmp_path: Path) -> None:
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "buffer_count": 4}))
    with pytest.raises(ConfigError, match="'buffer_count' is an infinity key.*offload_param"):
        OffloadConfig.from_file(path)


# --------------------------------------------------------------------------- DeepSpeed examples


def test_example_files_match_shared_seeds() -> None:
    shared = Path("/work/shared/configs")
    for name in ("seed_zero3_nvme.json", "seed_zero2_cpu.json"):
        assert (EXAMPLES / name).is_file()
        if (shared / name).is_file():
            assert json.loads((EXAMPLES / name).read_text()) == json.loads(
                (shared / name).read_text()
            )


def test_seed_zero3_nvme(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(str(EXAMPLES / "seed_zero3_nvme.json"))
    assert c.offload_param == "nvme" and c.offload_optimizer == "cpu"
    assert c.nvme_path == (Path("/mnt/nvme_storage"),)  # a placeholder: not checked here
    assert c.buffer_count == 5
    assert c.buffer_size == 200_000_000  # 1e8 fp16 elements
    assert c.pin_memory is True
    assert c.precision == PrecisionConfig(dtype="fp16")
    assert c.batch == BatchConfig(train_batch_size=256, gradient_accumulation_steps=4)
    assert c.aio == AioConfig() and c.gradient_clipping == 0.0
    only_one(caplog, "buffer_size 100000000 -> buffer_size 200000000")
    fixed = only_one(caplog, "fixed answer here")
    for key in ("contiguous_gradients", "reduce_scatter"):
        assert key in fixed
    assert c.zero_stage == 3 and c.overlap_comm is True
    assert c.reduce_bucket_size == 1_000_000_000  # 5e8 fp16 elements
    assert c.allgather_bucket_size == 1_000_000_000
    only_one(
        caplog,
        "DeepSpeed config mapped: ZeRO stage 3, offload_param=nvme, "
        "offload_optimizer=cpu, dtype=fp16",
    )
    assert not [m for m in messages(caplog) if "other than offloading" in m]


def test_seed_zero2_cpu(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(EXAMPLES / "seed_zero2_cpu.json")
    assert c.offload_param == "none" and c.offload_optimizer == "cpu"
    assert c.pin_memory is True and c.gradient_clipping == 1.0
    assert c.precision == PrecisionConfig("fp16", 0.0, 16, 1000, 2, 1.0)
    assert c.batch == BatchConfig(32, 4, 8)
    assert c.buffer_size is None  # the ignored offload_param section changes nothing
    line = only_one(caplog, "other than offloading")
    assert line.endswith("ignored: optimizer, scheduler, wall_clock_breakdown")
    line = only_one(caplog, "DeepSpeed ignores offload_param below stage 3 too")
    assert "stage 2" in line and "parameters stay on the device" in line
    assert "offload_param='none'" in line
    only_one(caplog, "ZeRO stage 2, offload_param=none, offload_optimizer=cpu")


# --------------------------------------------------------------------------- DeepSpeed mapping


def ds(zero: dict | None = None, **top: object) -> dict:
    data: dict = dict(top)
    if zero is not None:
        data["zero_optimization"] = zero
    return data


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (
            ds({"stage": 3, "offload_param": {"device": "nvme", "buffer_cout": 5}}),
            "unknown key 'buffer_cout' in offload_param; did you mean 'buffer_count'?",
        ),
        (ds({"stag": 3}), "unknown key 'stag' in zero_optimization; did you mean 'stage'?"),
        (
            ds({"stage": 2, "offload_optimizer": {"pin_memroy": True}}),
            "unknown key 'pin_memroy' in offload_optimizer; did you mean 'pin_memory'?",
        ),
        (ds(aio={"queue_dept": 8}), "unknown key 'queue_dept' in aio; did you mean 'queue_depth'?"),
        (ds(fp16={"enabeld": True}), "unknown key 'enabeld' in fp16; did you mean 'enabled'?"),
        (ds(bf16={"enable": True}), "unknown key 'enable' in bf16; did you mean 'enabled'?"),
        (
            ds(zero_optimisation={}),
            "unknown key 'zero_optimisation' in the DeepSpeed config; did "
            "you mean 'zero_optimization'?",
        ),
        (ds(train_batch_sise=4), "did you mean 'train_batch_size'?"),
    ],
)
def test_deepspeed_typos(data: dict, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_deepspeed(data)
    assert str(info.value) == text or text in str(info.value)


def test_deepspeed_unknown_top_level_without_match() -> None:
    with pytest.raises(ConfigError, match="unknown key 'qqqq' in the DeepSpeed config; valid"):
        OffloadConfig.from_deepspeed({"qqqq": 1})


def test_deepspeed_defaults_when_sections_missing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed({})
    assert (c.offload_param, c.offload_optimizer) == ("none", "none")
    assert c == OffloadConfig(offload_param="none")
    c = OffloadConfig.from_deepspeed(ds({"stage": 3}))
    assert (c.offload_param, c.offload_optimizer) == ("none", "none")


def test_deepspeed_optimizer_offload_honoured_below_stage_3() -> None:
    for stage in (0, 1, 2):
        c = OffloadConfig.from_deepspeed(
            ds(
                {
                    "stage": stage,
                    "offload_optimizer": {
                        "device": "nvme",
                        "nvme_path": ["/n0", "/n1"],
                        "buffer_count": 6,
                        "pin_memory": False,
                    },
                }
            )
        )
        assert c.offload_optimizer == "nvme" and c.offload_param == "none"
        assert c.nvme_path == (Path("/n0"), Path("/n1"))
        assert c.buffer_count == 6 and c.pin_memory is False


def test_deepspeed_both_nvme_sections_share_paths_and_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(
        ds(
            {
                "stage": 3,
                "offload_param": {
                    "device": "nvme",
                    "nvme_path": "/n0",
                    "buffer_count": 4,
                    "pin_memory": True,
                },
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": ["/n0", "/n1"],
                    "buffer_count": 7,
                    "pin_memory": False,
                },
            }
        )
    )
    assert c.nvme_path == (Path("/n0"), Path("/n1"))
    assert c.buffer_count == 7 and c.pin_memory is True
    only_one(caplog, "disagree on pin_memory")
    only_one(caplog, "uses the larger, 7")


def test_deepspeed_element_counts_converted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    zero = {
        "stage": 3,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "offload_param": {"device": "nvme", "buffer_size": 1e8, "max_in_cpu": 1e9},
    }
    fp32 = OffloadConfig.from_deepspeed(ds(zero))
    assert fp32.prefetch_bytes == 200_000_000 and fp32.buffer_size == 400_000_000
    assert fp32.prefetch_bucket_size == 200_000_000  # the all-gathers ahead, across ranks
    assert fp32.max_in_cpu == 4_000_000_000 and fp32.param_persistence_threshold == 100_000
    assert "at 4 bytes/element (fp32)" in only_one(caplog, "counts these in elements")
    bf16 = OffloadConfig.from_deepspeed(ds(zero, bf16={"enabled": True}))
    assert bf16.precision.dtype == "bf16" and bf16.buffer_size == 200_000_000
    explicit = OffloadConfig.from_deepspeed(
        ds(
            {"stage": 3, "offload_param": {"device": "nvme", "buffer_size": "256MiB"}},
            fp16={"enabled": True},
        )
    )
    assert explicit.buffer_size == 256 << 20  # a unit means bytes as written


def test_deepspeed_stage3_keys_ignored_below_stage_3(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(ds({"stage": 2, "stage3_prefetch_bucket_size": 100}))
    assert c.prefetch_bytes is None
    assert "stage3_prefetch_bucket_size" in only_one(caplog, "does not have, ignored")
    assert c.zero_stage == 2


def test_deepspeed_communication_keys(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(
        ds(
            {
                "stage": 3,
                "overlap_comm": False,
                "reduce_bucket_size": 5e7,
                "contiguous_gradients": True,
                "reduce_scatter": True,
                "allgather_bucket_size": 5e8,
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "sub_group_size": 1e9,
            }
        )
    )
    assert c.zero_stage == 3 and c.overlap_comm is False
    assert c.reduce_bucket_size == 200_000_000  # elements at fp32
    assert c.allgather_bucket_size == 2_000_000_000
    line = only_one(caplog, "fixed answer here")
    for key in ("contiguous_gradients", "reduce_scatter"):
        assert key in line
    assert "allgather_bucket_size" not in line
    line = only_one(caplog, "accepted but not used")
    for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"):
        assert key in line
    assert OffloadConfig.from_deepspeed(ds({"stage": 0})).zero_stage == 1


def test_deepspeed_aio_and_legacy_thread_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(
        ds(
            aio={
                "block_size": 262144,
                "queue_depth": 32,
                "thread_count": 4,
                "single_submit": False,
                "overlap_events": True,
                "use_gds": False,
            }
        )
    )
    assert c.aio == AioConfig(block_size=262144, queue_depth=32, thread_count=4)
    line = only_one(caplog, "not applicable")
    assert "single_submit, overlap_events, use_gds" in line
    new = OffloadConfig.from_deepspeed(ds(aio={"intra_op_parallelism": 2, "thread_count": 2}))
    assert new.aio.thread_count == 2
    with pytest.raises(ConfigError, match="disagree"):
        OffloadConfig.from_deepspeed(ds(aio={"intra_op_parallelism": 2, "thread_count": 3}))
    assert OffloadConfig.from_deepspeed(ds(aio={"block_size": "2MiB"})).aio.block_size == 2 << 20


def test_deepspeed_unused_keys_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    OffloadConfig.from_deepspeed(
        ds(
            {
                "stage": 3,
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "sub_group_size": 1e9,
                "offload_optimizer": {
                    "device": "cpu",
                    "fast_init": True,
                    "ratio": 0.5,
                    "pipeline_read": True,
                    "pipeline_write": False,
                },
            },
            fp16={"enabled": True, "auto_cast": False},
            steps_per_print=10,
            tensorboard={},
        )
    )
    line = only_one(caplog, "accepted but not used: stage3_max_live_parameters")
    assert "device_budget" in line and "sub_group_size" in line
    line = only_one(caplog, "offload_optimizer keys with no meaning here")
    assert "fast_init=True, ratio=0.5, pipeline_read=True, pipeline_write=False" in line
    assert "auto_cast" in only_one(caplog, "fp16/bf16 keys accepted but not used")
    assert only_one(caplog, "other than offloading").endswith("steps_per_print, tensorboard")


def test_deepspeed_precision() -> None:
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        OffloadConfig.from_deepspeed(ds(fp16={"enabled": True}, bf16={"enabled": True}))
    c = OffloadConfig.from_deepspeed(
        ds(fp16={"enabled": True, "loss_scale": 1024, "min_loss_scale": 2})
    )
    assert c.precision == PrecisionConfig("fp16", 1024.0, min_loss_scale=2.0)
    assert OffloadConfig.from_deepspeed(ds(bfloat16={"enabled": True})).precision.dtype == "bf16"
    assert OffloadConfig.from_deepspeed(ds(fp16={"enabled": False})).precision.dtype == "fp32"
    with pytest.raises(ConfigError, match="fp16.enabled='yes'"):
        OffloadConfig.from_deepspeed(ds(fp16={"enabled": "yes"}))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (ds({"stage": 4}), "zero_optimization.stage=4 .*0..3"),
        (ds({"stage": "3"}), "zero_optimization.stage='3'"),
        (ds({"stage": True}), "zero_optimization.stage=True"),
        (
            ds({"stage": 3, "offload_param": {"device": "disk"}}),
            "offload_param.device='disk' .*'none', 'cpu', 'nvme'",
        ),
        (
            ds({"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 0}}),
            "buffer_count=0 .*set by DeepSpeed key 'zero_optimization.offload_param.buffer_count'",
        ),
        (
            ds({"stage": 3, "offload_param": {"device": "nvme", "pin_memory": "yes"}}),
            "offload_param.pin_memory='yes'",
        ),
        (ds(aio={"queue_depth": 0}), "aio.queue_depth=0"),
        (
            ds(train_batch_size=10, train_micro_batch_size_per_gpu=4),
            "set by DeepSpeed key 'train_batch_size'",
        ),
        (ds(gradient_clipping=-1), "gradient_clipping=-1 "),
        (ds({"offload_param": []}), "offload_param must be a JSON object"),
        (ds(zero=None, bf16={"enabled": True}, bfloat16={"enabled": True}), "keep only 'bf16'"),
    ],
)
def test_deepspeed_bad_values(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_deepspeed(data)


def test_deepspeed_auto_values(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(
        ds(
            {"stage": 3, "stage3_prefetch_bucket_size": "auto", "offload_param": {"device": "cpu"}},
            train_batch_size="auto",
            gradient_clipping="auto",
            fp16={"enabled": "auto"},
        )
    )
    assert c.offload_param == "cpu" and c.prefetch_bytes is None
    assert c.batch.train_batch_size is None and c.precision.dtype == "fp32"
    line = only_one(caplog, "'auto' values")
    assert "zero_optimization.stage3_prefetch_bucket_size" in line and "fp16.enabled" in line


def test_deepspeed_legacy_cpu_offload_keys() -> None:
    c = OffloadConfig.from_deepspeed(
        ds(
            {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": False,
            }
        )
    )
    assert (c.offload_param, c.offload_optimizer, c.pin_memory) == ("cpu", "cpu", False)


def test_deepspeed_nvme_path_on_cpu_section_ignored(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="infinity.config")
    c = OffloadConfig.from_deepspeed(
        ds({"stage": 2, "offload_optimizer": {"device": "cpu", "nvme_path": "/n"}})
    )
    assert c.nvme_path == ()
    only_one(caplog, "offload_optimizer.nvme_path is ignored")


def test_aio_request_timeout_is_validated_and_reaches_the_engine(tmp_path) -> None:
    assert OffloadConfig().aio.request_timeout == 60.0
    assert OffloadConfig.from_dict({"aio": {"request_timeout": None}}).aio.request_timeout is None
    for bad in (0, -1, "soon", float("inf")):
        with pytest.raises(ConfigError, match="aio.request_timeout"):
            OffloadConfig.from_dict({"aio": {"request_timeout": bad}})
    with pytest.raises(ConfigError, match="request_timeout"):
        OffloadConfig.from_dict({"aio": {"request_timout": 5}})
    import torch

    from infinity import TieredStore

    store = TieredStore(
        OffloadConfig.from_dict({"nvme_path": str(tmp_path), "aio": {"request_timeout": 7.5}})
    )
    store.attach(torch.nn.Linear(8, 8))
    assert store.engine.settings.request_timeout == 7.5
    store.close()


def test_every_engine_made_from_a_config_takes_its_whole_aio_section() -> None:
    """The store, the KV cache's NVMe tier and the tools' disk probes build their engines
    through ``AioConfig.engine_settings``: each aio key reaches them, not only some."""
    aio = OffloadConfig.from_dict(
        {
            "aio": {
                "backend": "threads",
                "block_size": "256KiB",
                "queue_depth": 3,
                "thread_count": 2,
                "request_timeout": 7.5,
            }
        }
    ).aio
    settings = aio.engine_settings(file_size=1 << 24, verify_checksums=False)
    assert (settings.backend, settings.block_size, settings.queue_depth) == (
        "threads",
        256 << 10,
        3,
    )
    assert (settings.thread_count, settings.request_timeout) == (2, 7.5)
    assert (settings.file_size, settings.verify_checksums) == (1 << 24, False)
    assert OffloadConfig().aio.engine_settings().request_timeout == 60.0
