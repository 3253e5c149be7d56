"""The docs site's generated reference (docs/hooks/reference.py): every config field and every
DeepSpeed key the mapping knows appear in it, with what from_deepspeed actually does with them.
make docs builds the whole site strictly; these check the generator's content on its own."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import infinity
from infinity import deepspeed_config
from infinity.config import AioConfig, BatchConfig, OffloadConfig, PrecisionConfig

pytest.importorskip("mkdocs")

HOOK = Path(__file__).resolve().parents[1] / "docs" / "hooks" / "reference.py"


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_field_has_a_section(hook: ModuleType) -> None:
    page = hook.config_page()
    sections = [("", OffloadConfig), ("aio.", AioConfig), ("precision.", PrecisionConfig)]
    sections.append(("batch.", BatchConfig))
    for prefix, cls in sections:
        for f in dataclasses.fields(cls):
            if f.metadata["rule"].kind == "section":
                assert f"[`{f.name}`](#{f.name})" in page
                continue
            key = prefix + f.name
            assert f"### `{key}` {{#{key.replace('.', '')}}}" in page, key


def test_deepspeed_keys_map_as_from_deepspeed_does(hook: ModuleType) -> None:
    mapping = hook.deepspeed_mapping()
    assert set(mapping) == set(deepspeed_config.mapped_keys())
    # elements become bytes at fp32's 4 bytes
    assert mapping["zero_optimization.offload_param.buffer_size"] == [
        ("buffer_size", 1_000_000, 4_000_000)
    ]
    assert ("precision.dtype", True, "bf16") in mapping["bf16.enabled"]
    prefetch = {ours for ours, _, _ in mapping["zero_optimization.stage3_prefetch_bucket_size"]}
    assert prefetch == {"prefetch_bytes", "prefetch_bucket_size"}
    page = hook.config_page()
    assert "`zero_optimization.offload_param.buffer_size` (elements: x 4 bytes" in page


def test_bf16_auto_stays_fp32() -> None:
    """What the migration page says of HF's placeholder, as the mapping does it."""
    config = infinity.OffloadConfig.from_deepspeed({"bf16": {"enabled": "auto"}})
    assert config.precision.dtype == "fp32"
    config = infinity.OffloadConfig.from_deepspeed({"bf16": {"enabled": True}})
    assert config.precision.dtype == "bf16"


def test_unused_keys_page_lists_every_group(hook: ModuleType) -> None:
    page = hook.deepspeed_keys_page()
    for group, keys in deepspeed_config.unused_keys().items():
        assert f"## {group}" in page
        for key in keys:
            assert f"| `{key}` |" in page


def test_docstring_entries_and_memory_cost(hook: ModuleType) -> None:
    @dataclasses.dataclass
    class Sample:
        """A sample.

        alpha: the first. Memory: 4 bytes/param. More text.
        beta, gamma: both of
            them. No memory cost.
        When all are given, nothing.
        """

        alpha: int = 0
        beta: int = 0
        gamma: int = 0
        delta: int = 0

    entries = hook.docstring_entries(Sample)
    assert entries == {
        "alpha": "the first. Memory: 4 bytes/param. More text.",
        "beta": "both of them. No memory cost.",
        "gamma": "both of them. No memory cost.",
    }
    assert hook.memory_cost(entries["alpha"]) == "4 bytes/param."
    assert hook.memory_cost(entries["beta"]) == "none"
    assert hook.memory_cost("no statement") == ""


def test_stats_keys_all_described(hook: ModuleType) -> None:
    page = hook.stats_page()
    for key in ("bytes_read", "stall_seconds", "update_mode_reasons", "rss_bound", "comm"):
        assert f"| `{key}` |" in page
