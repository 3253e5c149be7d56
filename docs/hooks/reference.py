"""mkdocs hook: the reference pages generated from the code at every build, so they cannot drift.

* ``reference/config.md``: every field of ``OffloadConfig`` and its sections (``AioConfig``,
  ``PrecisionConfig``, ``BatchConfig``), from ``dataclasses.fields``: key, type, default, the
  rule its value is checked against, its description and memory cost (from the class
  docstring), and the DeepSpeed key that sets it, found by feeding ``from_deepspeed`` one key at
  a time and reading which field changed. A field without a description or a memory cost, a
  DeepSpeed key that ``infinity.deepspeed_config`` maps but no probe here sets, or a probe that
  changes nothing fails the build.
* ``reference/deepspeed-keys.md``: the DeepSpeed keys accepted but not used, with the reason the
  mapping gives.
* ``reference/cli.md``: each console script of ``pyproject.toml``'s ``[project.scripts]`` and its
  ``--help``, called in this process.
* ``reference/stats.md``: the keys of ``TieredStore.stats()``, read from the dictionaries of
  ``infinity/observability/reporting.py`` with the comment above each key, or the description
  below; a key with neither fails the build.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import logging
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tomllib
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# --------------------------------------------------------------------------- the config


def docstring_entries(cls: type) -> dict[str, str]:
    """``name: text`` entries of a class docstring (at the docstring's own indent, continued
    deeper); a line ``a, b: text`` describes each of them."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        match = re.match(r"^([a-z_]+(?:, [a-z_]+)*): (.*)$", line)
        if match:
            current = [match.group(2).strip()]
            for name in match.group(1).split(", "):
                entries[name] = current
        elif current is not None and line.startswith("    "):
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(text) for name, text in entries.items()}


def _rst_to_md(text: str) -> str:
    return text.replace("``", "`")


def memory_cost(text: str) -> str:
    """The docstring's first ``Memory:`` / ``Disk:`` sentence, or its 'No memory cost'."""
    match = re.search(r"((?:Memory|Disk)[a-z ]*:\s.*?\.)(?:\s|$)", text)
    if match:
        cost = match.group(1)
        return cost[len("Memory: ") :] if cost.startswith("Memory: ") else cost
    if "No memory cost" in text:
        return "none"
    return ""


def _format_default(f: dataclasses.Field[Any], rule: Any) -> str:
    from infinity.config_rules import format_size

    if f.default_factory is not dataclasses.MISSING:  # a section
        return "see below"
    value = f.default
    if value is None:
        return "`None`"
    if rule is not None and rule.size and isinstance(value, int) and value:
        return f"`{value}` ({format_size(value)})"
    if isinstance(value, tuple) and not value:
        return "`()` (a private temporary directory)"
    return f"`{value!r}`"


def _format_rule(rule: Any) -> str:
    if rule is None:
        return ""
    parts = []
    if rule.kind == "choice":
        parts.append("one of " + ", ".join(f"`{c}`" for c in rule.choices))
    elif rule.kind in ("int", "float"):
        noun = "integer" if rule.kind == "int" else "number"
        if rule.lo is not None and rule.hi is not None:
            parts.append(f"{noun} in {rule.lo:g}..{rule.hi:g}")
        elif rule.lo is not None:
            parts.append(f"{noun} >= {rule.lo:g}")
        else:
            parts.append(noun)
        if rule.size:
            parts.append("bytes; strings such as `'64MiB'` accepted")
    elif rule.kind == "bool":
        parts.append("`true` or `false`")
    elif rule.kind == "bool_or_auto":
        parts.append("`true`, `false` or `'auto'`")
    elif rule.kind == "paths":
        parts.append("a path or a list of paths, one per drive")
    elif rule.kind == "device":
        parts.append("`auto`, `cpu`, `cuda` or `cuda:N`")
    elif rule.kind == "section":
        parts.append("a section")
    if rule.optional:
        parts.append("or `None`")
    return "; ".join(parts)


# DeepSpeed key path -> (value, other keys it needs). Every key infinity.deepspeed_config maps
# must have one: the build fails otherwise, and where a probe changes no field.
_NVME_PARAM = {"zero_optimization.offload_param.device": "nvme"}
_NVME_OPTIM = {"zero_optimization.offload_optimizer.device": "nvme"}
PROBES: dict[str, tuple[Any, dict[str, Any]]] = {
    "zero_optimization.stage": (2, {}),
    "zero_optimization.offload_param.device": ("cpu", {}),
    "zero_optimization.offload_param.nvme_path": ("/mnt/nvme0", _NVME_PARAM),
    "zero_optimization.offload_param.buffer_count": (7, _NVME_PARAM),
    "zero_optimization.offload_param.buffer_size": (1_000_000, _NVME_PARAM),
    "zero_optimization.offload_param.pin_memory": (False, _NVME_PARAM),
    "zero_optimization.offload_param.max_in_cpu": (1_000_000, _NVME_PARAM),
    "zero_optimization.offload_optimizer.device": ("nvme", {}),
    "zero_optimization.offload_optimizer.nvme_path": ("/mnt/nvme1", _NVME_OPTIM),
    "zero_optimization.offload_optimizer.pin_memory": (False, _NVME_OPTIM),
    "zero_optimization.offload_optimizer.buffer_count": (9, _NVME_OPTIM),
    "zero_optimization.stage3_prefetch_bucket_size": (1_000_000, {}),
    "zero_optimization.stage3_param_persistence_threshold": (12345, {}),
    "zero_optimization.cpu_offload": (True, {"zero_optimization.stage": 2}),
    "zero_optimization.cpu_offload_param": (True, {}),
    "zero_optimization.cpu_offload_use_pin_memory": (False, {}),
    "zero_optimization.overlap_comm": (False, {}),
    "zero_optimization.reduce_bucket_size": (1_000_000, {}),
    "zero_optimization.allgather_bucket_size": (1_000_000, {}),
    "aio.block_size": (2 << 20, {}),
    "aio.queue_depth": (32, {}),
    "aio.intra_op_parallelism": (3, {}),
    "aio.thread_count": (3, {}),
    "fp16.enabled": (True, {}),
    "fp16.loss_scale": (128.0, {}),
    "fp16.initial_scale_power": (12, {}),
    "fp16.loss_scale_window": (500, {}),
    "fp16.hysteresis": (4, {}),
    "fp16.min_loss_scale": (0.5, {}),
    "bf16.enabled": (True, {}),
    "bfloat16.enabled": (True, {}),
    "gradient_clipping": (1.0, {}),
    "train_batch_size": (64, {}),
    "train_micro_batch_size_per_gpu": (4, {}),
    "gradient_accumulation_steps": (2, {}),
}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def deepspeed_mapping() -> dict[str, list[tuple[str, Any, Any]]]:
    """Our fields each DeepSpeed key sets: {ds path: [(field, value given, value set)]}."""
    from infinity import deepspeed_config as ds
    from infinity.config import OffloadConfig

    missing = sorted(set(ds.mapped_keys()) - set(PROBES))
    stale = sorted(set(PROBES) - set(ds.mapped_keys()))
    if missing or stale:
        raise PluginError(
            f"docs/hooks/reference.py: DeepSpeed keys mapped without a probe: {missing}; "
            f"probes for keys no longer mapped: {stale}"
        )
    quiet = logging.getLogger("infinity.config")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        result: dict[str, list[tuple[str, Any, Any]]] = {}
        for path, (value, context) in PROBES.items():
            base = {"zero_optimization.stage": 3, **context}
            before = _flatten(OffloadConfig.from_deepspeed(_nest(base)).to_dict())
            after = _flatten(OffloadConfig.from_deepspeed(_nest({**base, path: value})).to_dict())
            changed = [(k, value, after[k]) for k in after if after[k] != before[k]]
            if not changed:
                raise PluginError(f"docs/hooks/reference.py: DeepSpeed key {path} set no field")
            result[path] = changed
        return result
    finally:
        quiet.setLevel(level)


def _unit(given: Any, set_to: Any) -> str:
    if isinstance(given, bool) or not isinstance(given, int) or not isinstance(set_to, int):
        return ""
    if set_to == given * 4 and given:
        return "elements: x 4 bytes, x 2 under fp16/bf16"
    return ""


def config_page() -> str:
    from infinity.config import AioConfig, BatchConfig, OffloadConfig, PrecisionConfig

    mapping = deepspeed_mapping()
    by_field: dict[str, list[str]] = {}
    for path, changes in mapping.items():
        for ours, given, set_to in changes:
            unit = _unit(given, set_to)
            by_field.setdefault(ours, []).append(f"`{path}`" + (f" ({unit})" if unit else ""))

    classes: list[tuple[str, type]] = [
        ("", OffloadConfig),
        ("aio.", AioConfig),
        ("precision.", PrecisionConfig),
        ("batch.", BatchConfig),
    ]
    undocumented: list[str] = []
    summary = ["| key | type | default | DeepSpeed key |", "|---|---|---|---|"]
    sections: list[str] = []
    for prefix, cls in classes:
        described = docstring_entries(cls)
        title = (
            "OffloadConfig" if not prefix else f"`{prefix[:-1]}`: {cls.__name__} {{#{prefix[:-1]}}}"
        )
        sections.append(f"## {title}\n")
        first = (cls.__doc__ or "").strip().splitlines()[0]
        sections.append(_rst_to_md(first) + "\n")
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            rule = f.metadata.get("rule")
            text = described.get(f.name, "").strip()
            if not text:
                undocumented.append(f"{cls.__name__}.{f.name}")
                continue
            ds_keys = ", ".join(by_field.get(key, [])) or "-"
            # a table cell cannot hold a pipe, not even in a code span
            type_text = " or ".join(f"`{part}`" for part in str(f.type).split(" | "))
            default = _format_default(f, rule)
            summary.append(
                f"| [`{key}`](#{key.replace('.', '')}) | {type_text} | {default} | {ds_keys} |"
            )
            if rule is not None and rule.kind == "section":
                continue
            memory = memory_cost(text)
            if not memory:
                undocumented.append(f"{cls.__name__}.{f.name} (its memory cost)")
            sections.append(f"### `{key}` {{#{key.replace('.', '')}}}\n")
            sections.append("| type | default | allowed | memory cost | DeepSpeed key |")
            sections.append("|---|---|---|---|---|")
            sections.append(
                f"| {type_text} | {default} | {_format_rule(rule)} | "
                f"{_rst_to_md(memory) or '-'} | {ds_keys} |\n"
            )
            sections.append(_rst_to_md(text[:1].upper() + text[1:]) + "\n")
    if undocumented:
        raise PluginError(
            "config fields without a description, or without a 'Memory:' / 'Disk:' / 'No "
            "memory cost' in it, in their class docstring: " + ", ".join(undocumented)
        )
    head = (
        "# Configuration reference\n\n"
        "Generated at every docs build from the dataclasses of `infinity.config` and the "
        "DeepSpeed mapping of `infinity.deepspeed_config`: the key, its type and default, the "
        "rule its value is checked against, what it does and costs (the class docstring), and "
        "the DeepSpeed key that sets it (found by giving `OffloadConfig.from_deepspeed` each "
        "key alone). Every value is validated when the config is built: a wrong one raises "
        "`ConfigError` naming the key, the value and the fix; an unknown key names the closest "
        "valid one. Sizes accept strings: `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB` are powers "
        "of 1024; `KB`, `MB`, `GB`, `TB` powers of 1000.\n\n"
        "In Python, sections are their dataclasses "
        "(`OffloadConfig(precision=PrecisionConfig(dtype='bf16'))`, or "
        "`config.replace(precision={'dtype': 'bf16'})`); in JSON (`OffloadConfig.from_file`) "
        "they are nested objects. DeepSpeed keys marked *elements* are converted to bytes at "
        "the working dtype's size. Keys a DeepSpeed config accepts without using are listed in "
        "[DeepSpeed keys not used](deepspeed-keys.md); the migration itself is in "
        "[Migrating from DeepSpeed](../migration-deepspeed.md).\n\n"
        "## Summary\n"
    )
    return head + "\n".join(summary) + "\n\n" + "\n".join(sections)


def deepspeed_keys_page() -> str:
    from infinity import deepspeed_config as ds

    lines = [
        "# DeepSpeed keys accepted but not used",
        "",
        "Generated from `infinity.deepspeed_config`. `OffloadConfig.from_deepspeed` accepts "
        "these keys and logs one line naming them; a key in none of these lists and not "
        "[mapped](config.md) is an error naming the closest valid key.",
        "",
    ]
    for group, entries in ds.unused_keys().items():
        lines += [f"## {group}", "", "| key | why nothing here |", "|---|---|"]
        for key, why in entries.items():
            lines.append(f"| `{key}` | {why} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- console scripts


def cli_page() -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    lines = [
        "# Console scripts",
        "",
        "Installed with the package; generated from each script's own `--help` at every docs "
        "build.",
        "",
    ]
    for name, target in sorted(scripts.items()):
        module_name, _, func_name = target.partition(":")
        main: Callable[[list[str]], Any] = getattr(importlib.import_module(module_name), func_name)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
        text = out.getvalue().strip()
        if not text:
            raise PluginError(f"{name} ({target}) printed no --help")
        text = text.replace(str(ROOT), ".")
        lines += [f"## `{name}`", "", f"`{target}`", "", "```text", text, "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- stats() keys

#: keys of stats() whose dictionary line carries no comment
STATS_KEYS = {
    "current_bytes": "bytes held now per tier: `device`, `host`, `nvme`",
    "peak_bytes": "the peak of each tier's bytes since attach: `device`, `host`, `nvme`",
    "budgets": "the budgets in force, given or derived (bytes): device, host and their parts",
    "bytes_read": "bytes read from the swap files since attach",
    "bytes_written": "bytes written to the swap files since attach",
    "io_seconds": "seconds of reads plus seconds of writes (they overlap each other)",
    "read_seconds": "seconds reads were in flight",
    "write_seconds": "seconds writes were in flight",
    "stall_seconds": "seconds the training thread waited for a transfer",
    "steps": "optimizer steps taken",
    "prefetched_loads": "shards read ahead of their use",
    "demand_loads": "shards read when they were needed (each a wait)",
    "step_read_ahead_loads": "shards the optimizer step read ahead of its updates",
    "grad_bytes": "bytes of gradients the store holds now",
    "pinned_bytes": "bytes of page-locked host memory (with CUDA)",
    "rss_peak_bytes": "the process's peak RSS, as sampled",
    "trace_departures": "iterations that left the recorded trace (the schedule adapted)",
    "backend": "the swap engine's I/O backend (`uring`, `threads`, `buffered`), None without one",
    "io_timeouts": "requests that outlasted `aio.request_timeout`",
    "integrity_errors": "chunks whose checksum or identity did not match on read-back",
    "optimizer_state_dtype": "`precision.optimizer_state_dtype`",
    "state_read": "bytes of optimizer state read, as stored",
    "state_read_as_fp32": "the same state's bytes in fp32",
    "state_written": "bytes of optimizer state written, as stored",
    "state_written_as_fp32": "the same state's bytes in fp32",
    "compute_read_as_masters": "the same reads' bytes had the masters been read",
    "compute_written": "bytes of compute copies written",
    "storage_dtype": "`precision.storage_dtype`",
    "stored_bytes": "bytes of the parameters as stored between uses",
    "quantized_params": "parameters stored quantized",
    "rank": "this rank",
    "world": "the number of ranks",
    "stage": "the ZeRO stage",
    "backend@comm": "the process group's backend",
    "gathered_bytes": "bytes this rank sent into all-gathers (its slices)",
    "reduced_bytes": "bytes this rank sent into reductions (whole gradients)",
    "gather_seconds": "seconds the training thread waited for all-gathers",
    "reduce_seconds": "seconds the training thread waited for reductions",
}


def _dict_keys(func: ast.FunctionDef, lines: list[str]) -> Iterator[tuple[str, str]]:
    """(key, comment above it) for the dictionary ``func`` returns."""
    for node in ast.walk(func):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            for key in node.value.keys:
                if not isinstance(key, ast.Constant):
                    continue
                comment: list[str] = []
                row = key.lineno - 2
                while row >= 0 and lines[row].strip().startswith("#"):
                    comment.insert(0, lines[row].strip().lstrip("#").strip())
                    row -= 1
                yield str(key.value), " ".join(comment)
            return


def stats_page() -> str:
    path = ROOT / "infinity" / "observability" / "reporting.py"
    source = path.read_text()
    lines = source.splitlines()
    functions = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    groups = [
        ("store_stats", "", "`store.stats()`"),
        ("_comm_stats", "comm", "`stats()['comm']` (None in one process)"),
        ("_compression_stats", "compression", "`stats()['compression']`"),
        ("_weight_stats", "weights", "`stats()['weights']`"),
    ]
    out = [
        "# `stats()` keys",
        "",
        "Generated from `infinity/observability/reporting.py` at every docs build. "
        "`store.stats()` reads the tiers, the swap engine and the counters without changing "
        "them; byte counts are ints, seconds floats. `stats()['rss_bound']` is "
        "`store.rss_bound()` (see [Tiers and the RSS bound](../concepts/tiers.md)); "
        "`stats()['activations']` is described in [Activations](../how-to/activations.md).",
        "",
    ]
    missing = []
    for func_name, group, title in groups:
        out += [f"## {title}", "", "| key | what |", "|---|---|"]
        lead = ""  # the last key with a comment: the keys below it without one share it
        for key, comment in _dict_keys(functions[func_name], lines):
            text = STATS_KEYS.get(f"{key}@{group}") or comment or STATS_KEYS.get(key, "")
            if comment:
                lead = key
            elif not text and lead:
                text = f"see `{lead}`"
            if not text:
                missing.append(f"{group or 'stats'}.{key}")
            out.append(f"| `{key}` | {text.replace('|', '/')} |")
        out.append("")
    if missing:
        raise PluginError(
            "stats() keys with no comment in reporting.py and no description in "
            f"docs/hooks/reference.py: {', '.join(missing)}"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- the hook


def changelog_page() -> str:
    """CHANGELOG.md, its links into docs/ made relative to the site."""
    return (ROOT / "CHANGELOG.md").read_text().replace("](docs/", "](")


PAGES: dict[str, Callable[[], str]] = {
    "changelog.md": changelog_page,
    "reference/config.md": config_page,
    "reference/deepspeed-keys.md": deepspeed_keys_page,
    "reference/cli.md": cli_page,
    "reference/stats.md": stats_page,
}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    return files


def main() -> None:
    """``python docs/hooks/reference.py``: print the generated pages (for a look)."""
    for uri, make in PAGES.items():
        print(f"=== {uri}\n{make()}")


if __name__ == "__main__":
    main()
