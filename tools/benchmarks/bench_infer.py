"""Inference benchmark: a Llama streamed from NVMe by the store, against the model in RAM and
accelerate's disk offload.

The model (default: 219.7 M parameters, hidden 1024, 12 layers, MLP 2816, vocab 32000, untied
embeddings; 0.88 GB in fp32) gets random weights and is saved with ``save_pretrained``
(safetensors) to a temporary directory on the disk measured. In one run, each system in a worker
process of its own (kept for the whole run, so heaps, caches and the store's trace are each its
own), their repetitions interleaved, the median forward over 1 x 128 tokens of:
  * ram: the model in memory (``from_pretrained``), plain PyTorch;
  * accelerate: ``accelerate.disk_offload`` with its offload directory on the same disk, the page
    cache dropped before each forward (``/proc/sys/vm/drop_caches``, else ``posix_fadvise``
    DONTNEED on every file of the offload directory);
  * ours: built on the meta device, attached with ``offload_param="nvme"`` under a 256 MiB host
    and 128 MiB device budget, ``load_pretrained``, warm-up forwards (the first records the
    trace), then the timed ones;
  * ours-bf16, ours-int8, ours-int4 (``--weights``): the same with the weights stored in bf16
    or quantized (``precision.storage_dtype``, int4 in groups of ``--group-size``), converted
    as they are read, under a host budget scaled by the stored bytes per weight against fp32's
    (a half, about a quarter, about a seventh): each holds the same share of its weights in
    host memory as ours does, so every forward reads the rest from the disk (the device budget
    is ours': device copies are in the compute dtype, fp32).
Between rounds the swap engine reads 1 GiB with O_DIRECT on the same disk. It prints each
system's median, ours / accelerate (goal <= 0.5), the floor max(ram, weight bytes / engine read
GB/s) and ours / floor (goal <= 1.15), bytes read per forward against the weight bytes, whether
ours gave the in-RAM logits, and then ``generate`` (greedy, a 32-token prompt, 16 new tokens)
for batch 1, 8, 32 and 64, attached (every storage format) and in RAM: tokens/s and bytes read
per token. The bf16 and quantized systems get the same figures against their own floor,
max(ram, stored bytes / engine read GB/s) (goal <= 1.2), and in place of equality the share of
positions whose top-1 next token is the in-RAM fp32 model's, and the largest logit difference.

Those floors assume that reading costs the compute nothing. On a machine with few cores it does
(the engine's submission and completion threads share the cores with torch's), so the in-RAM
worker also times its forward alone and beside the engine streaming reads
(:mod:`infinity.cli.common.contention`), and each system is shown against its overlap floor too:
its stored bytes read while the in-RAM forward computes, each slowed as measured. Nothing that
reads its weights during the forward can beat that floor here. Decoding a stored format is
further work for the same cores: the in-RAM worker times decoding every weight of each format
once, and its CPU floor is the in-RAM forward plus that. Both floors at once are that sum with
the stored bytes read beside it, each slowed as measured; beside them each stored format shows
the decoding the store did in its own forwards.

    python -m tools.benchmarks.bench_infer [--quick] [--host-budget 256MiB --device-budget 128MiB]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from infinity.cli.common import contention
from infinity.cli.generate import (
    DiskProbe,
    build_empty_model,
    inspect_model_dir,
    offload_config,
    timed_generate,
)
from infinity.config import DTYPE_BYTES, format_size, parse_size
from infinity.inference.quantized import QUANTIZED_STORAGE, WeightQuantization, WeightQuantizer
from tools.benchmarks.infer_report import ATOL, STORED_SYSTEMS, SYSTEMS, summarize

FULL = {
    "hidden": 1024,
    "layers": 12,
    "intermediate": 2816,
    "vocab": 32000,
    "heads": 16,
    "host_budget": "256MiB",
    "device_budget": "128MiB",
    "reps": 5,
    "batches": "1,8,32,64",
}
#: a 21 M-parameter model with budgets in the same proportion to it
QUICK = {
    "hidden": 512,
    "layers": 4,
    "intermediate": 1408,
    "vocab": 8000,
    "heads": 8,
    "host_budget": "24MiB",
    "device_budget": "20MiB",
    "reps": 2,
    "batches": "1,8",
}
MARK = "@bench-infer@ "  # a worker's result lines on stdout (libraries print there too)


# ---------------------------------------------------------------------------- workers


def stored_share(kind: str, hidden: int, group_size: int) -> float:
    """Bytes stored per weight element against fp32's (the matrices, which are nearly all of a
    Llama's bytes), as the store keeps them: an int8 row of ``hidden`` inputs, an int4 group."""
    if kind not in QUANTIZED_STORAGE:
        return DTYPE_BYTES[kind] / DTYPE_BYTES["fp32"]
    unit = hidden if kind == "int8" else group_size
    return WeightQuantizer(kind, unit).stored_bytes(unit) / (unit * DTYPE_BYTES["fp32"])


def drop_page_cache(files: Sequence[Path]) -> str:
    """Empties the page cache of ``files``; returns how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return "drop_caches"
    except OSError:
        pass
    # Without root: each file's cached pages (clean after the sync) are dropped one by one.
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


class Worker:
    """One system in this process: built at start, then one measurement per command."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.store = None
        self.cache_drop = ""
        self.generated = False
        self.reference = load_file(spec["reference"])  # safetensors: no pickle
        model_dir = Path(spec["model_dir"])
        started = time.perf_counter()
        system = spec["system"]
        self.stored_bytes = 0
        if system.startswith("ours"):
            import infinity

            nvme = Path(spec["nvme"])
            config = offload_config(
                nvme,
                spec["host_budget"],
                spec["device_budget"],
                spec["buffer_size"],
                device="cpu",
                weights=spec.get("weights", "auto"),
                group_size=spec.get("group_size", 128),
            )
            self.store = infinity.TieredStore(config)
            self.model = build_empty_model(
                inspect_model_dir(model_dir), torch.float32, self.store.device
            )
            self.store.attach(self.model, initialise=False)
            self.store.load_pretrained(model_dir)
            self.stored_bytes = self.store.stats()["weights"]["stored_bytes"]
        else:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.model.eval()
            if system == "ram":
                # from_pretrained leaves the weights memory-mapped from the safetensors files
                # (page cache, which the other worker's drops and memory pressure may take):
                # copied, they are in this process's own memory.
                with torch.no_grad():
                    for param in self.model.parameters():
                        param.data = param.data.clone()
            if system == "accelerate":
                import accelerate

                self.offload_dir = Path(spec["offload_dir"])
                accelerate.disk_offload(
                    self.model, self.offload_dir, execution_device=torch.device("cpu")
                )
                gc.collect()  # the in-memory weights go: from here on they come from the files
        self.setup_seconds = time.perf_counter() - started
        for _ in range(spec["warmup"]):
            self.forward()

    def forward(self) -> dict[str, Any]:
        if self.spec["system"] == "accelerate":
            self.cache_drop = drop_page_cache(
                sorted(p for p in self.offload_dir.rglob("*") if p.is_file())
            )
        before = self.store.stats() if self.store is not None else None
        with torch.no_grad():
            started = time.perf_counter()
            logits = self.model(self.reference["input_ids"]).logits
            seconds = time.perf_counter() - started
        result = {"seconds": seconds, "cache_drop": self.cache_drop}
        expected = self.reference["logits"]
        result["equal"] = torch.equal(logits, expected)
        result["allclose"] = torch.allclose(logits, expected, rtol=ATOL, atol=ATOL)
        result["max_abs_diff"] = (logits - expected).abs().max().item()
        # quantized weights change the logits: how often the next token stays the same
        result["top1_agreement"] = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
        if before is not None and self.store is not None:
            after = self.store.stats()
            for key in ("bytes_read", "stall_seconds", "read_seconds", "device_copy_seconds"):
                result[key] = after[key] - before[key]
        return result

    def contention(self) -> dict[str, float]:
        """This forward (the in-RAM model's) alone and beside the engine streaming reads on the
        disk measured, and the engine's read GB/s alone and beside it."""
        path = Path(self.spec["nvme"]) / "contention"
        path.mkdir(exist_ok=True)

        def forward() -> None:
            with torch.no_grad():
                self.model(self.reference["input_ids"])

        config = offload_config(path, None, None)
        # checksums as the store's reads verify them: their CPU is part of what reading costs
        settings = config.aio.engine_settings(verify_checksums=config.verify_checksums)
        try:
            found = contention.measure(path, settings, forward, warmup=1, reads_only=True)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return found.as_dict()

    def decode_seconds(self, kinds: list[str], group_size: int, repeats: int = 3) -> dict:
        """Per stored format: the seconds to convert every weight the format stores from its
        stored bytes into the compute dtype once (median of ``repeats``), into buffers made
        beforehand, as the store decodes into its device copies: the work a forward from that
        format does beside the in-RAM one."""
        out: dict[str, float] = {}
        params = [(n, p.detach()) for n, p in self.model.named_parameters()]
        for kind in kinds:
            quantization = WeightQuantization.from_precision(kind, group_size)
            jobs: list[Any] = []
            for name, param in params:
                target = torch.empty(param.numel(), dtype=param.dtype)
                quantizer = quantization.quantizer_for(name, param) if quantization else None
                if quantizer is not None:
                    stored = torch.empty(quantizer.stored_bytes(param.numel()), dtype=torch.uint8)
                    quantizer.encode(param.reshape(-1), stored)
                    jobs.append((quantizer.decode, stored, target))
                elif kind == "bf16" and param.is_floating_point():
                    jobs.append((_copy_into, param.reshape(-1).to(torch.bfloat16), target))
            times = []
            for _ in range(repeats + 1):  # the first faults the targets in
                started = time.perf_counter()
                for decode, stored, target in jobs:
                    decode(stored, target)
                times.append(time.perf_counter() - started)
            out[kind] = statistics.median(times[1:])
        return out

    def generate(self, batch: int, prompt: int, new: int) -> dict[str, Any]:
        vocab = self.model.config.vocab_size
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, prompt), generator=generator)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        # min_new_tokens: random weights may emit EOS early; every row makes all ``new`` tokens
        kwargs = {
            "do_sample": False,
            "max_new_tokens": new,
            "min_new_tokens": new,
            "pad_token_id": self.model.generation_config.pad_token_id or 0,
        }
        if not self.generated:  # generate's one-time setup is not part of any batch's figure
            with torch.no_grad():
                self.model.generate(
                    **{k: v[:1, :4] for k, v in inputs.items()},
                    **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2},
                )
            self.generated = True
        out, timing = timed_generate(self.model, self.store, inputs, **kwargs)
        timing["sequences"] = out.tolist()
        return timing

    def close(self) -> None:
        if self.store is not None:
            self.store.close(restore_params=False)


def _copy_into(stored: torch.Tensor, target: torch.Tensor) -> None:
    target.copy_(stored)


def worker_main(spec: dict[str, Any]) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    worker = Worker(spec)

    def reply(value: dict[str, Any]) -> None:
        print(MARK + json.dumps(value), flush=True)

    reply(
        {"ready": True, "setup_seconds": worker.setup_seconds, "stored_bytes": worker.stored_bytes}
    )
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "forward":
            reply(worker.forward())
        elif command["cmd"] == "contention":
            reply(worker.contention())
        elif command["cmd"] == "decode":
            reply(worker.decode_seconds(command["kinds"], command["group_size"]))
        elif command["cmd"] == "generate":
            reply(worker.generate(command["batch"], command["prompt"], command["new"]))
        else:
            break
    worker.close()
    return 0


class Remote:
    """A worker process and its command pipe."""

    def __init__(self, spec: dict[str, Any], log_path: Path) -> None:
        self.name = spec["system"]
        self.log_path = log_path
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tools.benchmarks.bench_infer", "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        self.process.wait()
        self.log.flush()
        tail = self.log_path.read_text()[-3000:]
        raise RuntimeError(f"the {self.name} worker exited ({self.process.returncode}):\n{tail}")

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask(cmd="quit")
            except (RuntimeError, BrokenPipeError, ValueError):
                pass
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


# ---------------------------------------------------------------------------- the run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_infer",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a 21 M-param model, smaller budgets, 2 repetitions, batches 1 and 8",
    )
    p.add_argument(
        "--dir",
        type=Path,
        help="where the model, accelerate's offload files and the swap files go "
        "(default: a temporary directory under $TMPDIR, on the disk measured)",
    )
    p.add_argument(
        "--host-budget", help=f"ours (default {FULL['host_budget']}, quick {QUICK['host_budget']})"
    )
    p.add_argument(
        "--device-budget",
        help=f"ours (default {FULL['device_budget']}, quick {QUICK['device_budget']})",
    )
    p.add_argument(
        "--buffer-size",
        help="ours: swap buffer and largest shard (default: an "
        "eighth of the host budget, at most 64MiB)",
    )
    p.add_argument(
        "--reps",
        type=int,
        help=f"timed forwards per system (default {FULL['reps']}, quick {QUICK['reps']})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed forwards per system first; ours records its trace in the first (%(default)s)",
    )
    p.add_argument("--seq", type=int, default=128, help="tokens per forward (%(default)s)")
    p.add_argument(
        "--batches",
        help=f"generate batch sizes (default {FULL['batches']}, quick "
        f"{QUICK['batches']}; 'none' skips generate)",
    )
    p.add_argument("--prompt-tokens", type=int, default=32, help="(%(default)s)")
    p.add_argument("--new-tokens", type=int, default=16, help="(%(default)s)")
    p.add_argument(
        "--disk-bytes",
        default="1GiB",
        help="bytes the swap engine reads per bandwidth measurement (%(default)s)",
    )
    p.add_argument(
        "--weights",
        default="bf16,int8,int4",
        help="ours again with the weights stored in these formats, under budgets scaled by "
        "their bytes (%(default)s; 'none': skip)",
    )
    p.add_argument("--group-size", type=int, default=128, help="int4's group (%(default)s)")
    p.add_argument("--json", type=Path, help="write every measurement to this JSON file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    preset = QUICK if args.quick else FULL
    for key in ("host_budget", "device_budget", "reps", "batches"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.model_shape = {
        k: preset[k] for k in ("hidden", "layers", "intermediate", "vocab", "heads")
    }
    try:
        args.host_budget = parse_size(args.host_budget, name="--host-budget")
        args.device_budget = parse_size(args.device_budget, name="--device-budget")
        args.buffer_size = (
            parse_size(args.buffer_size, name="--buffer-size") if args.buffer_size else None
        )
        args.disk_bytes = parse_size(args.disk_bytes, name="--disk-bytes")
        args.batches = (
            [] if args.batches == "none" else [int(b) for b in args.batches.split(",") if b.strip()]
        )
    except ValueError as exc:  # ConfigError is a ValueError too
        p.error(str(exc))
    kinds = [] if args.weights == "none" else args.weights.split(",")
    if any(kind not in STORED_SYSTEMS for kind in kinds):
        p.error(f"--weights {args.weights!r}: a list of bf16, int8, int4, or 'none'")
    args.systems = SYSTEMS + tuple(STORED_SYSTEMS[kind] for kind in kinds)
    if args.reps < 1 or args.warmup < 1 or min(args.batches, default=1) < 1:
        p.error(
            "--reps, --warmup and batch sizes must be >= 1 (ours records its trace in the "
            "first warm-up forward)"
        )
    return args


def save_model(shape: dict[str, int], model_dir: Path, seq: int, reference: Path) -> int:
    """Random weights saved with save_pretrained, and the in-RAM logits every system must give;
    returns the weight bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        intermediate_size=shape["intermediate"],
        vocab_size=shape["vocab"],
        num_attention_heads=shape["heads"],
        tie_word_embeddings=False,
        max_position_embeddings=max(2048, seq),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(model_dir)
    ids = torch.randint(0, shape["vocab"], (1, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()}, reference)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model_dir, work = root / "model", root / "work"
    work.mkdir()
    reference = root / "reference.safetensors"
    shape = args.model_shape
    print(
        f"model: Llama hidden {shape['hidden']}, {shape['layers']} layers, MLP "
        f"{shape['intermediate']}, vocab {shape['vocab']}, untied; saving random weights to "
        f"{model_dir} ...",
        flush=True,
    )
    weight_bytes = save_model(shape, model_dir, args.seq, reference)
    gc.collect()
    print(
        f"  {weight_bytes / 4 / 1e6:.1f} M params, fp32 {weight_bytes / 1e9:.3f} GB; forward "
        f"1 x {args.seq} tokens; ours: host budget {format_size(args.host_budget)}, device "
        f"budget {format_size(args.device_budget)}; {args.warmup} warm-up + {args.reps} timed "
        f"forwards per system, interleaved",
        flush=True,
    )
    base = {
        "model_dir": str(model_dir),
        "reference": str(reference),
        "warmup": args.warmup,
        "host_budget": args.host_budget,
        "device_budget": args.device_budget,
        "buffer_size": args.buffer_size,
        "nvme": str(work),
        "offload_dir": str(root / "accelerate-offload"),
    }
    remotes: dict[str, Remote] = {}
    load_at_start = os.getloadavg()[0]
    results: dict[str, Any] = {
        "weight_bytes": weight_bytes,
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "dir", "worker")},
    }
    try:
        systems = args.systems
        results["stored_bytes"] = {}
        for system in systems:  # one at a time: their setups would compete for the cores
            spec = {**base, "system": system, "group_size": args.group_size}
            if system in STORED_SYSTEMS.values():
                kind = system.removeprefix("ours-")
                share = stored_share(kind, shape["hidden"], args.group_size)
                spec["weights"] = kind
                spec["host_budget"] = int(args.host_budget * share)
            remotes[system] = Remote(spec, root / f"{system}.log")
            ready = remotes[system].receive()
            results["stored_bytes"][system] = ready["stored_bytes"]
            budget = (
                f", host budget {format_size(spec['host_budget'])}"
                if system.startswith("ours")
                else ""
            )
            print(
                f"  {system}: ready in {ready['setup_seconds']:.1f} s (+ {args.warmup} "
                f"warm-up forwards){budget}",
                flush=True,
            )
        forwards: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        disk: list[float] = []
        with DiskProbe([work], args.disk_bytes, offload_config(work, None, None)) as probe:
            for rep in range(args.reps):
                # no system always goes first
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
                for system in order:
                    forwards[system].append(remotes[system].ask(cmd="forward"))
                disk.append(probe.read())
                print(
                    f"  round {rep + 1}: "
                    + ", ".join(f"{s} {forwards[s][-1]['seconds']:.3f} s" for s in systems)
                    + f", engine read {disk[-1] / 1e9:.2f} GB/s",
                    flush=True,
                )
        results["forwards"] = forwards
        results["disk_read_bps"] = disk
        print("  the in-RAM forward alone and beside the engine's reads ...", flush=True)
        results["contention"] = remotes["ram"].ask(cmd="contention")
        kinds = [s.removeprefix("ours-") for s in systems if s in STORED_SYSTEMS.values()]
        if kinds:
            print("  decoding every weight of each stored format, in RAM ...", flush=True)
            results["decode_seconds"] = remotes["ram"].ask(
                cmd="decode", kinds=kinds, group_size=args.group_size
            )
        generates: dict[int, dict[str, Any]] = {}
        for batch in args.batches:
            generates[batch] = {
                system: remotes[system].ask(
                    cmd="generate", batch=batch, prompt=args.prompt_tokens, new=args.new_tokens
                )
                for system in ("ram", "ours", *systems[len(SYSTEMS) :])
            }
        results["generate"] = generates
        results["load"] = (load_at_start, os.getloadavg()[0])
    finally:
        for remote in remotes.values():
            remote.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bar would interleave with the rounds
    root = Path(tempfile.mkdtemp(prefix="infinity-bench-infer-", dir=args.dir))
    try:
        results = run(args, root)
    except RuntimeError as exc:
        print(f"bench_infer: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(summarize(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
