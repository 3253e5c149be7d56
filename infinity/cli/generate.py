"""infinity-generate: Hugging Face generation with the weights streamed from NVMe.

    infinity-generate --model ./llama --prompt "Once upon a time" --max-new-tokens 32
    infinity-generate --model ./llama --token-ids 1,450,7483 --batch-size 8 --json
    infinity-generate --model ./llama --nvme-path /mnt/nvme0 --host-budget 256MiB --dtype bf16
    infinity-generate --model ./llama --batch-size 32 --offload-kv nvme --kv-budget 64MiB
    infinity-generate --model ./llama --weights int4 --group-size 64

The model is built on the meta device (``accelerate.init_empty_weights``: parameters without
storage, buffers real), attached to a TieredStore with its parameters on NVMe and no optimizer,
and its safetensors weights are streamed in with ``store.load_pretrained``, so host memory never
holds the whole model. Hugging Face ``generate`` then runs unchanged; each forward reads what the
host and device budgets do not keep. Besides the text (or token ids) it reports tokens/s, the
prefill time, the decode time per token, bytes read per generated token, the read bandwidth
against the disk's (measured at the start with the swap engine, or given with --disk-gbps) and
the share of the run spent stalled on reads. With --offload-kv the KV cache's layers wait in host
RAM or on NVMe between uses (``store.kv_cache``), and the KV bytes written and read per
generated token are reported beside the weights'. With --weights the weights are stored on NVMe
in that format (``precision.storage_dtype``): int8 or int4 quantized once as they load and
decoded into the compute dtype as they stream in, bf16 or fp32 converted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity import OffloadConfig, PrecisionConfig, TieredStore
from infinity.checkpointing.pretrained import checkpoint_files
from infinity.cli.common.args import USER_ERRORS as COMMON_USER_ERRORS
from infinity.cli.common.args import UserError, config_size, guarded, parse, positive
from infinity.cli.common.transfers import run_transfers
from infinity.config import format_size
from infinity.errors import CheckpointError
from swap import (
    BufferPool,
    SwapEngine,
)
from swap.files import check_directory

log = logging.getLogger("infinity.cli.generate")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: any of these in the model directory means AutoTokenizer can load one from it
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "tokenizer_config.json",
)
DEFAULT_PROMPT = "The capital of France is"
DEFAULT_PROMPT_TOKENS = 8  # random ids when there is neither a prompt nor a tokenizer
DISK_PROBE_BYTES = 256 << 20
DEFAULT_BUFFER = 64 << 20  # largest swap buffer (and shard) the tool picks itself


#: What a user fixes by changing flags or paths (a checkpoint among them): one line, exit code 2.
USER_ERRORS: tuple[type[Exception], ...] = (*COMMON_USER_ERRORS, CheckpointError)


# ---------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infinity-generate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add = parser.add_argument
    add(
        "--model",
        type=Path,
        required=True,
        metavar="DIR",
        help="a Hugging Face model directory: config.json and model.safetensors (or shards with "
        "model.safetensors.index.json)",
    )
    add(
        "--nvme-path",
        type=Path,
        metavar="DIR",
        help="swap directory (default: a fresh temporary directory, removed at the end)",
    )
    add(
        "--host-budget",
        type=config_size,
        metavar="SIZE",
        help="host memory for the store, e.g. 256MiB (default: derived by the store)",
    )
    add(
        "--device-budget",
        type=config_size,
        metavar="SIZE",
        help="device memory for the store, e.g. 128MiB (default: derived by the store)",
    )
    add(
        "--buffer-size",
        type=config_size,
        metavar="SIZE",
        help="swap buffer and largest shard (default: an eighth of --host-budget, at most "
        f"{format_size(DEFAULT_BUFFER)})",
    )
    add(
        "--device", default="auto", help="where compute runs: auto, cpu, cuda, cuda:N (%(default)s)"
    )
    add(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="compute dtype; weights are converted to it as they stream in, so bf16/fp16 halve "
        "the bytes read (default: the model's own)",
    )
    add(
        "--weights",
        choices=("auto", "fp32", "bf16", "int8", "int4"),
        default="auto",
        help="how the weights are stored on NVMe and read per forward: as the compute dtype "
        "(auto), fp32, bf16, or quantized for inference: int8 (a scale per output channel, "
        "about a quarter of fp32's bytes) or int4 (a scale and minimum per --group-size "
        "elements, about an eighth) (%(default)s)",
    )
    add(
        "--group-size",
        type=positive(int),
        default=128,
        help="elements per int4 group; must divide the rows of every weight (%(default)s)",
    )
    add(
        "--prompt",
        action="append",
        default=[],
        help="text to continue (needs a tokenizer in --model); repeat for a batch of prompts",
    )
    add(
        "--token-ids",
        action="append",
        default=[],
        metavar="IDS",
        help="prompt as comma-separated token ids, e.g. 1,450,7483; repeat for several rows",
    )
    add(
        "--batch-size",
        type=positive(int),
        help="rows per batch; the prompts are repeated to fill it (default: one per prompt)",
    )
    add("--max-new-tokens", type=positive(int), default=32, help="(%(default)s)")
    add(
        "--ignore-eos",
        action="store_true",
        help="always generate --max-new-tokens (throughput runs on random weights)",
    )
    parser.set_defaults(sample=False)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--greedy", dest="sample", action="store_false", help="greedy decoding (the default)"
    )
    mode.add_argument(
        "--sample", dest="sample", action="store_true", help="sample with --temperature and --top-k"
    )
    add("--temperature", type=positive(float), default=1.0, help="(%(default)s)")
    add("--top-k", type=positive(int), default=50, help="(%(default)s)")
    add(
        "--seed",
        type=int,
        default=0,
        help="sampling seed, and the default random prompt's (%(default)s)",
    )
    add(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="untimed generate calls before the measured one (the first records the trace)",
    )
    add(
        "--disk-gbps",
        type=positive(float),
        metavar="GBPS",
        help="the disk's read bandwidth, instead of measuring it at the start",
    )
    add(
        "--offload-kv",
        choices=("none", "host", "nvme"),
        default="none",
        help="where the KV cache's layers wait between uses: none (generate's own cache, on "
        "the device), host (RAM) or nvme (swap files in --nvme-path) (%(default)s)",
    )
    add(
        "--kv-budget",
        type=config_size,
        metavar="SIZE",
        help="device bytes of KV cache at once with --offload-kv: two layers' worth lets the "
        "next be prefetched (default: a quarter of the device budget)",
    )
    add("--json", action="store_true", help="print one JSON object (outputs and summary) only")
    add("-v", "--verbose", action="store_true", help="log the runtime's INFO messages")
    return parser


# ---------------------------------------------------------------------------- the model directory


@dataclass
class ModelDir:
    path: Path
    config: Any  # transformers.PretrainedConfig
    files: list[Path]  # its safetensors files
    has_tokenizer: bool


def inspect_model_dir(path: Path) -> ModelDir:
    """Checks what the run needs from ``path`` before anything is built or written."""
    if not path.exists():
        raise UserError(
            f"--model {path} does not exist: pass a Hugging Face model directory "
            f"(config.json and model.safetensors), e.g. one written by "
            f"model.save_pretrained(dir)"
        )
    if not path.is_dir():
        raise UserError(
            f"--model {path} is not a directory: pass the directory holding "
            f"config.json and the safetensors files"
        )
    if not (path / "config.json").is_file():
        raise UserError(
            f"--model {path} holds no config.json: pass the model's directory "
            f"(save_pretrained writes config.json next to the weights)"
        )
    try:
        files = checkpoint_files(path)
    except CheckpointError as exc:
        hint = (
            "; it has PyTorch .bin weights: convert them with from_pretrained(dir)."
            "save_pretrained(dir, safe_serialization=True)"
            if any(path.glob("*.bin"))
            else ": pass a directory with safetensors weights (save_pretrained writes them)"
        )
        raise UserError(f"--model {path} has no safetensors weights ({exc}){hint}") from None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(
            f"--model {path}: config.json cannot be read as a Hugging Face config: {exc}"
        ) from None
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    return ModelDir(path, config, files, has_tokenizer)


def model_dtype(config: Any, requested: str) -> torch.dtype:
    if requested != "auto":
        return DTYPES[requested]
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def build_empty_model(model_dir: ModelDir, dtype: torch.dtype, device: torch.device) -> Any:
    """The causal LM of ``model_dir`` with parameters on the meta device and real buffers."""
    import accelerate
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        with accelerate.init_empty_weights():
            model = AutoModelForCausalLM.from_config(model_dir.config, dtype=dtype)
    except ValueError as exc:
        raise UserError(
            f"--model {model_dir.path}: not a causal language model transformers "
            f"can build ({type(model_dir.config).__name__}): {exc}"
        ) from None
    # init_empty_weights re-registers every parameter, which unties tied embeddings (GPT-2's
    # lm_head): tied again, the checkpoint's one copy fills both.
    model.tie_weights()
    if device.type != "cpu":
        # The store moves parameters, not buffers (rotary tables, masks): they go now.
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    if (model_dir.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir.path)
    return model.eval()


# ---------------------------------------------------------------------------- prompts


def parse_token_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(
            f"--token-ids {text!r}: expected comma-separated integers such as 1,450,7483"
        ) from None
    if not ids:
        raise UserError(f"--token-ids {text!r} holds no token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"--token-ids: {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


def prompt_rows(args: argparse.Namespace, model_dir: ModelDir, tokenizer: Any) -> list[list[int]]:
    """One list of token ids per prompt given (before the batch is filled)."""
    vocab = model_dir.config.get_text_config().vocab_size
    if args.prompt and args.token_ids:
        raise UserError("pass either --prompt or --token-ids, not both")
    if args.token_ids:
        return [parse_token_ids(text, vocab) for text in args.token_ids]
    if args.prompt or tokenizer is not None:
        prompts = args.prompt or [DEFAULT_PROMPT]
        rows = [tokenizer(text)["input_ids"] for text in prompts]
        if not all(rows):
            raise UserError("a --prompt encodes to no tokens: give it some text")
        return rows
    generator = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, vocab, (DEFAULT_PROMPT_TOKENS,), generator=generator).tolist()]


def batch_inputs(
    rows: list[list[int]], batch_size: int | None, pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of the rows, repeated to ``batch_size`` and padded
    on the left (a decoder-only model continues from the last position of every row)."""
    if batch_size is not None and batch_size < len(rows):
        raise UserError(
            f"--batch-size {batch_size} is smaller than the {len(rows)} prompts "
            f"given: raise it or pass fewer prompts"
        )
    rows = [rows[i % len(rows)] for i in range(batch_size or len(rows))]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def pad_token_id(generation_config: Any) -> int:
    for value in (generation_config.pad_token_id, generation_config.eos_token_id):
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    return 0


# ---------------------------------------------------------------------------- measuring


class DiskProbe:
    """The swap engine's read bandwidth on ``paths``: ``nbytes`` written once (O_DIRECT where
    the file system allows it, striped over the paths as the store's extents are), then read
    back in full by each :meth:`read`, with the store's aio and checksum settings."""

    def __init__(
        self,
        paths: Sequence[Path],
        nbytes: int,
        config: OffloadConfig,
        chunk: int = 16 << 20,
        depth: int = 4,
    ) -> None:
        self.depth = depth * len(paths)
        settings = config.aio.engine_settings(
            file_size=nbytes // len(paths) + 2 * chunk, verify_checksums=config.verify_checksums
        )
        self.pool = BufferPool(self.depth, chunk, name="disk-probe")
        try:
            self.engine = SwapEngine(list(paths), settings)
        except BaseException:
            self.pool.close()
            raise
        self.nbytes = nbytes
        try:
            self.extents = [
                self.engine.allocate(min(chunk, nbytes - offset))
                for offset in range(0, nbytes, chunk)
            ]
            self._pass(self.engine.write)
        except BaseException:
            self.close()
            raise

    def _pass(self, call: Any) -> float:
        return run_transfers([(call, extent) for extent in self.extents], self.pool.buffers)

    def read(self) -> float:
        """Bytes/s of one read pass over everything written, on the wall clock."""
        return self.nbytes / self._pass(self.engine.read)

    def close(self) -> None:
        self.engine.close()
        self.pool.close()

    def __enter__(self) -> DiskProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def forward_clock(model: nn.Module) -> Iterator[list[float]]:
    """The perf_counter times at which each forward of ``model`` ended: generate's first
    forward is the prefill, each later one decodes one token per row."""
    ends: list[float] = []
    handle = model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
    try:
        yield ends
    finally:
        handle.remove()


def timed_generate(
    model: Any, store: TieredStore | None, inputs: dict[str, torch.Tensor], **kwargs: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``model.generate(**inputs, **kwargs)`` under no_grad, with its timings and the store's
    I/O during it (zeros without a store)."""
    keys = ("bytes_read", "read_seconds", "stall_seconds")
    before = store.stats() if store is not None else {}
    with torch.no_grad(), forward_clock(model) as ends:
        started = time.perf_counter()
        out = model.generate(**inputs, **kwargs)
        seconds = time.perf_counter() - started
    after = store.stats() if store is not None else {}
    io = {key: after.get(key, 0) - before.get(key, 0) for key in keys}
    batch, prompt = inputs["input_ids"].shape
    new = out.shape[1] - prompt
    tokens = batch * new
    decode_steps = len(ends) - 1
    return out, {
        "batch": batch,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "forwards": len(ends),
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "prefill_seconds": ends[0] - started if ends else 0.0,
        "decode_seconds_per_token": (ends[-1] - ends[0]) / decode_steps
        if decode_steps
        else math.nan,
        "bytes_read": io["bytes_read"],
        "bytes_read_per_token": io["bytes_read"] / tokens if tokens else 0.0,
        "bytes_read_per_forward": io["bytes_read"] / len(ends) if ends else 0.0,
        # bytes over the seconds the engine had reads in flight, and over the whole call
        "read_gbps": io["bytes_read"] / io["read_seconds"] / 1e9 if io["read_seconds"] else 0.0,
        "read_gbps_wall": io["bytes_read"] / seconds / 1e9 if seconds else 0.0,
        "stall_seconds": io["stall_seconds"],
        "stall_share": io["stall_seconds"] / seconds if seconds else 0.0,
    }


# ---------------------------------------------------------------------------- the run


def check_nvme_path(path: Path) -> Path:
    path = check_directory(path)  # missing, a file, read-only: named as such
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise UserError(
            f"--nvme-path {path} is not writable ({exc.strerror or exc}): choose a "
            f"directory on a writable drive, or fix its permissions"
        ) from None
    return path


def offload_config(
    nvme: Path,
    host_budget: int | None,
    device_budget: int | None,
    buffer_size: int | None = None,
    device: str = "auto",
    weights: str = "auto",
    group_size: int = 128,
) -> OffloadConfig:
    """Parameters on NVMe under the budgets, no optimizer, stored as ``weights``
    (precision.storage_dtype); the swap buffers fill the host budget."""
    changes: dict[str, Any] = {}
    if host_budget is not None:
        if buffer_size is None:
            # Eight buffers in the budget: shards are at most one buffer, so several are read
            # ahead while a module computes, each read still large enough for the disk.
            buffer_size = min(DEFAULT_BUFFER, max(64 << 10, host_budget // 8 >> 12 << 12))
        changes["buffer_count"] = max(2, host_budget // buffer_size)
    if buffer_size is not None:
        changes["buffer_size"] = buffer_size
    return OffloadConfig(
        offload_param="nvme",
        offload_optimizer="none",
        nvme_path=(nvme,),
        host_budget=host_budget,
        device_budget=device_budget,
        device=device,
        precision=PrecisionConfig(storage_dtype=weights, quant_group_size=group_size),
        **changes,
    )


def generate_kwargs(args: argparse.Namespace, pad_id: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.sample,
        "pad_token_id": pad_id,
    }
    if args.sample:
        kwargs.update(temperature=args.temperature, top_k=args.top_k)
    if args.ignore_eos:
        kwargs["min_new_tokens"] = args.max_new_tokens
    return kwargs


@contextlib.contextmanager
def kv_cache(store: TieredStore, args: argparse.Namespace) -> Iterator[Any]:
    """The offloaded KV cache for one generate call (None with --offload-kv none); with nvme
    it swaps under the store's nvme_path, which is --nvme-path."""
    if args.offload_kv == "none":
        yield None
        return
    with store.kv_cache(target=args.offload_kv, budget=args.kv_budget) as cache:
        yield cache


def cache_kwargs(cache: Any) -> dict[str, Any]:
    return {} if cache is None else {"cache": cache}


def kv_figures(cache: Any, timing: dict[str, Any]) -> dict[str, Any]:
    """The KV cache's bytes through its tier during the measured call, per generated token."""
    if cache is None:
        return {"offload_kv": "none"}
    stats = cache.stats()
    tokens = timing["batch"] * timing["new_tokens"]
    return {
        "offload_kv": cache.config.target,
        "kv_budget": stats["kv_budget"],
        "kv_bytes_read": stats["kv_bytes_read"],
        "kv_bytes_written": stats["kv_bytes_written"],
        "kv_bytes_read_per_token": stats["kv_bytes_read"] / tokens if tokens else 0.0,
        "kv_bytes_written_per_token": stats["kv_bytes_written"] / tokens if tokens else 0.0,
        "kv_resident_layers_peak": stats["kv_resident_layers_peak"],
        "kv_resident_bytes_peak": stats["kv_resident_bytes_peak"],
        "kv_stored_bytes": stats["kv_stored_bytes"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.kv_budget is not None and args.offload_kv == "none":
        raise UserError("--kv-budget needs --offload-kv host or nvme")
    model_dir = inspect_model_dir(args.model)
    if args.prompt and not model_dir.has_tokenizer:
        raise UserError(
            f"--prompt needs a tokenizer, and --model {args.model} has none "
            f"({', '.join(TOKENIZER_FILES[:3])}): pass token ids with --token-ids "
            f"1,2,3, or save the tokenizer there (tokenizer.save_pretrained(dir))"
        )
    tokenizer = None
    if model_dir.has_tokenizer and not args.token_ids:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir.path)
        except (OSError, ValueError) as exc:
            raise UserError(
                f"--model {args.model}: its tokenizer cannot be loaded ({exc}); "
                f"pass --token-ids instead"
            ) from None
    rows = prompt_rows(args, model_dir, tokenizer)
    temp_dir: Path | None = None
    if args.nvme_path is None:
        temp_dir = Path(tempfile.mkdtemp(prefix="infinity-generate-"))
    nvme = check_nvme_path(args.nvme_path or temp_dir)  # type: ignore[arg-type]  # one is set
    store: TieredStore | None = None
    try:
        config = offload_config(
            nvme,
            args.host_budget,
            args.device_budget,
            args.buffer_size,
            args.device,
            args.weights,
            args.group_size,
        )
        disk_gbps = args.disk_gbps
        if disk_gbps is None:
            if shutil.disk_usage(nvme).free > 4 * DISK_PROBE_BYTES:
                with DiskProbe([nvme], DISK_PROBE_BYTES, config) as probe:
                    disk_gbps = probe.read() / 1e9
            else:
                log.warning(
                    "%s has too little free space to measure the disk; pass --disk-gbps", nvme
                )
        dtype = model_dtype(model_dir.config, args.dtype)
        started = time.perf_counter()
        store = TieredStore(config)
        model = build_empty_model(model_dir, dtype, store.device)
        store.attach(model, initialise=False)
        result = store.load_pretrained(model_dir.path)
        load_seconds = time.perf_counter() - started
        # A buffer the checkpoint lacks keeps the value the config built it with; a parameter
        # would have none.
        params = dict(model.named_parameters(remove_duplicate=False))
        missing = [name for name in result.missing_keys if name in params]
        if missing:
            raise UserError(
                f"--model {args.model}: the checkpoint lacks {len(missing)} of the "
                f"model's weights (e.g. {missing[:3]}): it is not this config's "
                f"model"
            )
        pad_id = pad_token_id(model.generation_config)
        inputs = batch_inputs(rows, args.batch_size, pad_id, store.device)
        kwargs = generate_kwargs(args, pad_id)
        for _ in range(args.warmup):
            with kv_cache(store, args) as cache, torch.no_grad():
                model.generate(**inputs, **kwargs, **cache_kwargs(cache))
        torch.manual_seed(args.seed)
        with kv_cache(store, args) as cache:
            out, timing = timed_generate(model, store, inputs, **kwargs, **cache_kwargs(cache))
            kv = kv_figures(cache, timing)
        stats = store.stats()
    finally:
        if store is not None:
            store.close(restore_params=False)
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    prompt = inputs["input_ids"].shape[1]
    sequences = out.tolist()
    summary: dict[str, Any] = {
        "model": str(model_dir.path),
        "architecture": type(model).__name__,
        "parameters": sum(e.numel for e in store.registry.entries),
        "weight_bytes": stats["budgets"].get("params", 0),
        # as stored (--weights), against the bytes they came in; quantized ones apart
        "weights": args.weights,
        "weight_storage": stats["weights"],
        "dtype": str(dtype).split(".")[-1],
        "device": str(store.device),
        "nvme_path": str(nvme),
        "budgets": stats["budgets"],
        "backend": stats["backend"],
        "load_seconds": load_seconds,
        "unexpected_keys": list(result.unexpected_keys),
        "sampling": "sample" if args.sample else "greedy",
        **timing,
        **kv,
        "disk_read_gbps": disk_gbps,
        "read_share_of_disk": timing["read_gbps"] / disk_gbps if disk_gbps else None,
        "sequences": sequences,
        "new_token_ids": [row[prompt:] for row in sequences],
    }
    if tokenizer is not None:
        summary["texts"] = tokenizer.batch_decode(out, skip_special_tokens=True)
    return summary


def report(summary: dict[str, Any]) -> list[str]:
    s, gb = summary, 1e9
    disk = s["disk_read_gbps"]
    lines = [
        f"model      {s['model']} ({s['architecture']}, {s['parameters'] / 1e6:.1f} M params,"
        f" {s['dtype']} compute, weights {weights_text(s)} on NVMe, loaded in "
        f"{s['load_seconds']:.1f} s)",
        f"store      device {s['device']}: device budget "
        f"{format_size(s['budgets'].get('device'))}, host budget "
        f"{format_size(s['budgets'].get('host'))}, swap in {s['nvme_path']} "
        f"({s['backend']})",
        "",
    ]
    for i, row in enumerate(s.get("texts") or s["new_token_ids"]):
        lines.append(f"[{i}] {row if isinstance(row, str) else ','.join(map(str, row))}")
    tokens = s["batch"] * s["new_tokens"]
    decode = s["decode_seconds_per_token"]
    disk_text = (
        f"; the disk reads {disk:.2f} GB/s, so {s['read_share_of_disk']:.0%} of it" if disk else ""
    )
    rows = [
        (
            "generated",
            f"{tokens} tokens ({s['batch']} rows x {s['new_tokens']} new after "
            f"{s['prompt_tokens']} prompt tokens, {s['sampling']}) in "
            f"{s['seconds']:.2f} s",
        ),
        ("tokens/s", f"{s['tokens_per_second']:.2f}"),
        ("prefill", f"{s['prefill_seconds']:.3f} s"),
        (
            "decode",
            "-"
            if math.isnan(decode)
            else f"{decode:.3f} s per token step ({s['forwards'] - 1} steps)",
        ),
        (
            "bytes read",
            f"{s['bytes_read'] / gb:.3f} GB: {s['bytes_read_per_token'] / 1e6:.1f} "
            f"MB per generated token, {s['bytes_read_per_forward'] / 1e6:.1f} MB "
            f"per forward",
        ),
        *kv_rows(s),
        (
            "read",
            f"{s['read_gbps']:.2f} GB/s while reading, {s['read_gbps_wall']:.2f} GB/s "
            f"over the run{disk_text}",
        ),
        (
            "stalls",
            f"{s['stall_seconds']:.2f} s waiting on reads, {s['stall_share']:.0%} of the run",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return lines + [""] + [f"{name:<{width}}  {value}" for name, value in rows]


def weights_text(s: dict[str, Any]) -> str:
    storage = s["weight_storage"]
    if not storage["quantized_params"]:
        return f"{s['weights']} {format_size(s['weight_bytes'])}"
    return (
        f"{s['weights']} {format_size(s['weight_bytes'])} ({storage['quantized_params']} "
        f"quantized, {format_size(storage['given_bytes'])} as given)"
    )


def kv_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    if s.get("offload_kv", "none") == "none":
        return []
    return [
        (
            "kv cache",
            f"on {s['offload_kv']}: {s['kv_bytes_read'] / 1e6:.1f} MB read, "
            f"{s['kv_bytes_written'] / 1e6:.1f} MB written: "
            f"{s['kv_bytes_read_per_token'] / 1e6:.3f} MB read and "
            f"{s['kv_bytes_written_per_token'] / 1e6:.3f} MB written per generated token "
            f"({format_size(s['kv_stored_bytes'])} cached at the end, at most "
            f"{s['kv_resident_layers_peak']} layers, "
            f"{format_size(s['kv_resident_bytes_peak'])}, on the device, budget "
            f"{format_size(s['kv_budget'])})",
        )
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if isinstance(args, int):
        return args
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        print(
            f"{parser.prog}: error: transformers and accelerate are needed: pip install "
            f"'infinity-offload[hf]'",
            file=sys.stderr,
        )
        return 2
    if not args.verbose:
        hf_logging.set_verbosity_error()
    if args.warmup < 0:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: --warmup must be >= 0", file=sys.stderr)
        return 2
    code, summary = guarded(
        parser.prog, lambda: run(args), USER_ERRORS, "interrupted; swap files removed"
    )
    if code:
        return code
    if args.json:
        print(json.dumps(summary))
    else:
        print("\n".join(report(summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
