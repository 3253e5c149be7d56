"""Fine-tune benchmark: what people fine-tune, through ``InfinityTrainer``, on one machine.

Two shapes, each built with ``accelerate.init_empty_weights()`` (the model never exists in host
memory whole), attached with ``offload_param="nvme"``, ``offload_optimizer="nvme"`` and a host
budget (default 4 GiB), then trained ``--steps`` steps (default 3) of batch 1 x 128 by Hugging
Face Trainer (``InfinityTrainer``, the README's recipe, Trainer's defaults otherwise):

* ``8b``: the Llama-3-8B shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate
  14336, vocab 128256), full fine-tune, ``dtype="bf16", master_dtype="bf16",
  optimizer_state_dtype="int8"``: bf16 masters rounded stochastically, no compute copy, int8
  moments (about 6 bytes per parameter with the first step's gradients, 4 after);
* ``13b-lora``: a 13 B Llama shape (hidden 5120, 40 layers, 40 heads, intermediate 13824, vocab
  32000), peft LoRA r=16 on q/k/v/o with the base frozen, ``dtype="bf16", storage_dtype="bf16"``.

Each step prints its seconds, the bytes it read and wrote (``stats()``), the process's peak RSS
so far (``resource.getrusage``) and the swap directory's peak allocated bytes (its files'
blocks, sampled every 0.2 s). In the same run: the compute floor (plain PyTorch in memory,
bf16 weights, gradients and AdamW state, of the same shape with one layer and with two, in a
child process; one layer plus the others at the difference, as ``bench_scale``), and the I/O
floor (the step's bytes at the disk's speed: fio's read and write GB/s where fio is installed,
else the swap engine's combined read+write GB/s, both on the swap directory after the run);
each step against the larger of the two.

Before building it checks the free disk against what the run stores (trained parameters:
masters, compute copies beside fp32 ones, gradients in the masters' dtype, the moments in
their dtype; frozen ones: their bf16 weights) and says what it needs; a store that refuses
the attach (its own preflight) is reported with its reason, not a traceback. The full shapes
need 30-80 GB of disk and hours;
``--layers N`` (and ``--vocab V``) runs a shallower copy of each shape in seconds.

    python -m tools.benchmarks.bench_finetune [--shape 8b|13b-lora|both] [--layers N]
        [--vocab V] [--steps 3] [--host-budget 4GiB] [--nvme-path DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import infinity
from infinity.cli.common.transfers import engine_bandwidth
from infinity.cli.disk.fio import FioError, FioJob, FioRunner, find_fio
from infinity.config import parse_size
from infinity.core.state_sizes import stored_nbytes
from swap import SwapSpaceError
from tools.benchmarks.bench_scale import load_average

GIB = 1 << 30
#: what the disk measurement writes next to the state
BANDWIDTH_PASS_BYTES = 1 << 30


@dataclass(frozen=True)
class Shape:
    """A Llama shape and how it is fine-tuned."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    lora_rank: int | None  # None: full fine-tune
    state_dtype: str
    master_dtype: str

    def narrowed(self, by: int) -> Shape:
        """The shape with its widths and heads divided by ``by`` (a quick copy)."""
        return replace(
            self,
            hidden=self.hidden // by,
            intermediate=self.intermediate // by,
            heads=max(1, self.heads // by),
            kv_heads=max(1, self.kv_heads // by),
        )

    def precision(self) -> infinity.PrecisionConfig:
        return infinity.PrecisionConfig(
            dtype="bf16",
            storage_dtype="bf16",
            optimizer_state_dtype=self.state_dtype,
            master_dtype=self.master_dtype,
        )


SHAPES = {
    "8b": Shape("8b", 4096, 32, 32, 8, 14336, 128256, None, "int8", "bf16"),
    "13b-lora": Shape("13b-lora", 5120, 40, 40, 40, 13824, 32000, 16, "fp32", "fp32"),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def chosen(shape: Shape, args: argparse.Namespace) -> Shape:
    """``shape`` as the command line narrows it and stores its moments."""
    shape = shape.narrowed(args.narrow)
    return replace(shape, state_dtype=args.state_dtype) if args.state_dtype else shape


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    parser.add_argument("--layers", type=int, default=None, help="a shallower copy of the shape")
    parser.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary")
    parser.add_argument(
        "--narrow",
        type=int,
        default=1,
        help="divide the width, the MLP's width and the heads by this (a quick run, the tests)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument(
        "--host-budget", type=lambda v: parse_size(v, name="--host-budget"), default=4 * GIB
    )
    parser.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "int8"),
        default=None,
        help="the moments' optimizer_state_dtype (default: the shape's: int8 for 8b, fp32 for "
        "13b-lora)",
    )
    parser.add_argument(
        "--prefetch-depth", type=int, default=None, help="the store's prefetch_depth (its default)"
    )
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's (1.0)")
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Trainer's gradient_checkpointing (non-reentrant), in the compute floor too: what "
        "a fine-tune of this size on a small machine uses, so that the saved activations (1 GB "
        "on the 13 B shape, outside the host budget on a CPU device) stay small",
    )
    parser.add_argument("--nvme-path", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--compute-floor", help=argparse.SUPPRESS)  # the child: a shape's name
    return parser.parse_args(argv)


def llama_config(shape: Shape, args: argparse.Namespace, layers: int) -> Any:
    import transformers

    settings: dict[str, Any] = dict(
        vocab_size=args.vocab or shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(args.context, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaConfig(**settings)


def build(shape: Shape, args: argparse.Namespace, layers: int, empty: bool) -> torch.nn.Module:
    """The shape's model (on empty weights with ``empty``), LoRA-wrapped where the shape is. On
    empty weights peft puts the adapters on the meta device too; attach gives them peft's own
    initialisation (A as peft draws it, B zeros: the adapted model starts as its base)."""
    import accelerate
    import transformers

    config = llama_config(shape, args, layers)
    torch.manual_seed(0)
    model: Any
    if empty:
        with accelerate.init_empty_weights():
            model = transformers.LlamaForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(config)
        model.to(dtype=torch.bfloat16)
    if shape.lora_rank is not None:
        import peft

        lora = peft.LoraConfig(r=shape.lora_rank, lora_alpha=32, target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, lora)
    return model


def stored_per_param(shape: Shape) -> dict[str, float]:
    """Bytes on disk per trained parameter that the run keeps, by kind: masters (fp32, or bf16
    with master_dtype='bf16'), bf16 compute copies beside fp32 masters, gradients in the
    masters' dtype (the first step runs in optimizer.step() and stores them), two moments in
    their dtype; and per frozen parameter: its bf16 weights."""
    master = 2 if shape.master_dtype == "bf16" else 4
    return {
        "master": master,
        "compute copy": 2 if master == 4 else 0,
        "gradient": master,
        "moments": 2 * stored_nbytes(shape.state_dtype, 1 << 20) / (1 << 20),
        "frozen": 2.0,
    }


def needed_disk(shape: Shape, trained: int, frozen: int) -> int:
    per = stored_per_param(shape)
    per_frozen = per.pop("frozen")
    per_trained = sum(per.values())
    return int((trained * per_trained + frozen * per_frozen) * 1.02) + 2 * BANDWIDTH_PASS_BYTES


def allocated_bytes(directory: Path) -> int:
    """Bytes the files under ``directory`` have allocated on the disk (du's figure)."""
    total = 0
    for path in directory.rglob("*"):
        try:
            info = path.lstat()
        except OSError:  # removed while walking
            continue
        if path.is_file():
            total += info.st_blocks * 512
    return total


class DiskPeak:
    """The peak of :func:`allocated_bytes` of a directory, sampled from a thread."""

    def __init__(self, directory: Path, every: float = 0.2) -> None:
        self.directory, self.every = directory, every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-peak", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        now = allocated_bytes(self.directory)
        self.peak = max(self.peak, now)
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tokens_dataset(args: argparse.Namespace, vocab: int, count: int) -> Any:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (count, args.context), generator=generator)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return count

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": tokens[index], "labels": tokens[index]}

    return Tokens()


# -- the floors ---------------------------------------------------------------------------------
def plain_step_seconds(shape: Shape, args: argparse.Namespace, layers: int) -> float:
    """Seconds of a plain PyTorch step (forward, backward, fused AdamW over what the
    shape trains) of the shape with ``layers`` layers in memory, bf16 throughout."""
    model = build(shape, args, layers, empty=False)
    if args.gradient_checkpointing:
        hf_model: Any = model  # a transformers (or peft) model
        hf_model.gradient_checkpointing_enable({"use_reentrant": False})
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=True)
    tokens = tokens_dataset(args, args.vocab or shape.vocab, 1)[0]["input_ids"][None]
    times = []
    for _ in range(4):  # the first (kernels chosen, pages faulted in) untimed
        started = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return min(times[1:])  # a floor: the best of three, other work on the cores only slows it


def compute_floor(shape: Shape, args: argparse.Namespace, layers: int) -> dict[str, float]:
    """The compute floor of a step at ``layers`` layers, measured in a child process (its
    memory stays out of this one's peak)."""
    command = [sys.executable, "-m", "tools.benchmarks.bench_finetune", "--compute-floor"]
    command += [shape.name, f"--context={args.context}"]
    command += [f"--vocab={args.vocab}"] if args.vocab else []
    command += [f"--narrow={args.narrow}"]
    command += [] if args.gradient_checkpointing else ["--no-gradient-checkpointing"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    one, two = json.loads(done.stdout.strip().splitlines()[-1])
    per_layer = max(two - one, 0.0)
    return {
        "one_layer_s": one,
        "two_layers_s": two,
        "per_layer_s": per_layer,
        "floor_s": one + (layers - 1) * per_layer,
    }


def disk_speed(swap: Path, config: infinity.OffloadConfig) -> dict[str, Any]:
    """The disk's read and write bytes per second on ``swap``: fio's (1 MiB, 8 in flight,
    O_DIRECT) where installed, else the swap engine's, with its combined read+write figure."""
    fio, note = find_fio(install=False)
    if fio is not None:
        runner = FioRunner(fio, swap, BANDWIDTH_PASS_BYTES)
        try:
            if runner.prepare():
                write = runner.run(FioJob("write", 1 << 20, 8, BANDWIDTH_PASS_BYTES))
                read = runner.run(FioJob("read", 1 << 20, 8, BANDWIDTH_PASS_BYTES))
                return {"source": f"fio ({note})", "read": read.bw_bytes, "write": write.bw_bytes}
            note = runner.note
        except FioError as exc:
            note = f"fio failed: {exc}"
        finally:
            runner.cleanup()
    measured = engine_bandwidth(swap, BANDWIDTH_PASS_BYTES, config, combined=True)
    return {"source": f"swap engine ({note})", **measured}


def io_floor(speed: dict[str, Any], read: int, written: int) -> float:
    """Seconds to move a step's bytes at ``speed``: at the combined rate where measured (both
    directions at once), else each direction at its own rate, one after the other."""
    if "combined" in speed:
        return (read + written) / speed["combined"]
    return read / speed["read"] + written / speed["write"]


# -- one shape ----------------------------------------------------------------------------------
def run_shape(shape: Shape, args: argparse.Namespace, parent: Path) -> dict[str, Any]:
    layers = args.layers or shape.layers
    model = build(shape, args, layers, empty=True)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    vocab = args.vocab or shape.vocab
    result: dict[str, Any] = {
        "shape": shape.name,
        "layers": layers,
        "vocab": vocab,
        "trained_params": trained,
        "frozen_params": frozen,
        "precision": {
            "dtype": "bf16",
            "storage_dtype": "bf16",
            "state_dtype": shape.state_dtype,
            "master_dtype": shape.master_dtype,
        },
    }
    free = shutil.disk_usage(parent).free
    needed = needed_disk(shape, trained, frozen)
    result.update(disk_free=free, disk_needed=needed)
    per = stored_per_param(shape)
    per_frozen = per.pop("frozen")
    parts = ", ".join(f"{kind} {size:g}" for kind, size in per.items() if size)
    print(
        f"\n{shape.name}: Llama hidden {shape.hidden}, {layers} layers, vocab {vocab}: "
        f"{trained / 1e6:.1f} M trained + {frozen / 1e6:.1f} M frozen params; the run stores "
        f"{sum(per.values()):.1f} B per trained param ({shape.master_dtype} masters: {parts}; "
        f"moments in {shape.state_dtype}) and {per_frozen:g} per frozen one (bf16 weights), "
        f"and the disk measurement's 2 GiB: needs "
        f"{needed / 1e9:.1f} GB free on {parent} ({free / 1e9:.1f} GB free); "
        f"load average {load_average()}",
        flush=True,
    )
    if free < needed:
        result["refused"] = (
            f"needs {needed / 1e9:.1f} GB free on {parent}, which has {free / 1e9:.1f} GB: free "
            f"space, pass --nvme-path on a larger drive, or fewer --layers"
        )
        print(f"refused: {result['refused']}")
        return result
    root = Path(tempfile.mkdtemp(prefix="infinity-bench-finetune-", dir=parent))
    try:
        return train(shape, args, model, result, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def train(
    shape: Shape, args: argparse.Namespace, model: Any, result: dict[str, Any], root: Path
) -> dict[str, Any]:
    """Attaches ``model`` with its swap files under ``root``, trains it with InfinityTrainer,
    then measures the floors; ``result`` filled in and returned (with ``refused`` where the
    store refuses the attach)."""
    import transformers

    from infinity.integrations.hf import InfinityTrainer

    layers, vocab = result["layers"], result["vocab"]
    swap = root / "swap"
    swap.mkdir()
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(swap,),
        host_budget=args.host_budget,
        precision=shape.precision(),
        **({} if args.prefetch_depth is None else {"prefetch_depth": args.prefetch_depth}),
    )
    disk = DiskPeak(swap)
    store = infinity.TieredStore(config)
    try:
        started = time.perf_counter()
        optimizer: Any = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-5
        )
        try:
            model, optimizer = store.attach(model, optimizer)
        except (infinity.InfinityError, SwapSpaceError) as exc:
            result["refused"] = f"the store refused the attach: {type(exc).__name__}: {exc}"
            print(f"refused: {result['refused']}")
            return result
        result["attach_s"] = time.perf_counter() - started
        result["attach_peak_rss"] = peak_rss()
        print(
            f"attached in {result['attach_s']:.1f} s, peak RSS "
            f"{result['attach_peak_rss'] / GIB:.2f} GiB, swap files "
            f"{disk.sample() / 1e9:.2f} GB allocated",
            flush=True,
        )
        steps: list[dict[str, Any]] = []
        losses: list[float] = []
        marks: dict[str, Any] = {}

        class PerStep(transformers.TrainerCallback):
            def on_step_begin(self, *_: Any, **__: Any) -> None:
                for key in ("optimizer_stats", "optimizer_t"):  # the last step's
                    marks.pop(key, None)
                marks["stats"], marks["t"] = store.stats(), time.perf_counter()

            def on_pre_optimizer_step(self, *_: Any, **__: Any) -> None:
                # forward and backward end here (gradient clipping is before it, in Trainer)
                marks["optimizer_stats"], marks["optimizer_t"] = store.stats(), time.perf_counter()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                now = time.perf_counter()
                seconds = now - marks["t"]
                after, before = store.stats(), marks["stats"]
                middle = marks.get("optimizer_stats", after)
                record = {
                    "step_s": seconds,
                    "forward_backward_s": marks.get("optimizer_t", now) - marks["t"],
                    "optimizer_step_s": now - marks.get("optimizer_t", now),
                    "forward_backward_stall_s": middle["stall_seconds"] - before["stall_seconds"],
                    "optimizer_step_stall_s": after["stall_seconds"] - middle["stall_seconds"],
                    "bytes_read": after["bytes_read"] - before["bytes_read"],
                    "bytes_written": after["bytes_written"] - before["bytes_written"],
                    "stall_s": after["stall_seconds"] - before["stall_seconds"],
                    "peak_rss": peak_rss(),
                    "peak_disk": disk.peak,
                    "update_mode": before["update_mode"],
                }
                steps.append(record)
                print(
                    f"step {len(steps) - 1}: {seconds:.1f} s (forward and backward "
                    f"{record['forward_backward_s']:.1f} s, stalled "
                    f"{record['forward_backward_stall_s']:.1f}; optimizer.step() "
                    f"{record['optimizer_step_s']:.1f} s, stalled "
                    f"{record['optimizer_step_stall_s']:.1f}), read "
                    f"{record['bytes_read'] / 1e9:.2f} GB, written "
                    f"{record['bytes_written'] / 1e9:.2f} GB, peak RSS "
                    f"{record['peak_rss'] / GIB:.2f} GiB, swap directory peak "
                    f"{record['peak_disk'] / 1e9:.2f} GB",
                    flush=True,
                )

            def on_log(self, *_: Any, logs: dict | None = None, **__: Any) -> None:
                if logs and "loss" in logs:
                    losses.append(float(logs["loss"]))

        with tempfile.TemporaryDirectory(prefix="bench-finetune-", dir=root) as output_dir:
            trainer = InfinityTrainer(
                model=model,
                args=transformers.TrainingArguments(
                    output_dir=output_dir,
                    use_cpu=True,
                    max_steps=args.steps,
                    per_device_train_batch_size=1,
                    max_grad_norm=args.max_grad_norm,
                    gradient_checkpointing=args.gradient_checkpointing,
                    gradient_checkpointing_kwargs={"use_reentrant": False},
                    logging_steps=1,
                    save_strategy="no",
                    report_to=[],
                    dataloader_num_workers=0,
                    disable_tqdm=True,
                ),
                train_dataset=tokens_dataset(args, vocab, args.steps),
                optimizers=(optimizer, None),
                callbacks=[PerStep()],
            )
            trainer.train()
        for record, loss in zip(steps, losses):
            record["loss"] = loss
        result["steps"] = steps
        result["losses"] = losses
        result["stats"] = {
            k: v for k, v in store.stats().items() if isinstance(v, (int, float, str, bool))
        }
        # the store's bound on the peak RSS and its terms, beside the process's own peak
        result["rss_bound"] = store.rss_bound()
        # the disk the store's preflight counted beside what its swap files took (du's figure)
        accounting = store.stats()["disk"]
        result["disk_accounting"] = {
            k: accounting[k] for k in ("preflight_bytes", "allocated_bytes", "peak_allocated_bytes")
        }
        report_disk_accounting(result["disk_accounting"])
    finally:
        store.close(restore_params=False)
        disk.stop()
    result["peak_disk"] = disk.peak
    result["disk"] = disk_speed(swap, config)
    result["compute_floor"] = compute_floor(shape, args, layers)
    report_floors(result, args)
    return result


def report_disk_accounting(accounting: dict[str, int]) -> None:
    preflight, peak = accounting["preflight_bytes"], accounting["peak_allocated_bytes"]
    print(
        f"disk: the store's preflight {preflight / 1e9:.2f} GB, its swap files allocated "
        f"{accounting['allocated_bytes'] / 1e9:.2f} GB now and {peak / 1e9:.2f} GB at most "
        f"({peak / preflight if preflight else 0:.3f}x the preflight)"
    )


def report_floors(result: dict[str, Any], args: argparse.Namespace) -> None:
    speed, floor = result["disk"], result["compute_floor"]
    compute_s = floor["floor_s"]
    rates = ", ".join(
        f"{k} {speed[k] / 1e9:.2f}" for k in ("read", "write", "combined") if k in speed
    )
    print(
        f"disk by {speed['source']}: GB/s {rates}\n"
        f"compute floor {compute_s:.2f} s: plain PyTorch bf16 in memory, 1 layer "
        f"{floor['one_layer_s']:.2f} s, 2 layers {floor['two_layers_s']:.2f} s, so "
        f"{result['layers']} layers {floor['one_layer_s']:.2f} + {result['layers'] - 1} x "
        f"{floor['per_layer_s']:.2f} s; load average {load_average()}"
    )
    print(
        f"{'step':>4} {'s':>7} {'read GB':>8} {'written GB':>10} {'I/O floor s':>11} "
        f"{'x max floor':>11} {'peak RSS GiB':>12} {'disk peak GB':>12} {'loss':>7}"
    )
    for index, record in enumerate(result["steps"]):
        record["io_floor_s"] = io_floor(speed, record["bytes_read"], record["bytes_written"])
        record["compute_floor_s"] = compute_s
        both = max(record["io_floor_s"], compute_s)
        record["vs_max_floor"] = record["step_s"] / both if both else None
        print(
            f"{index:>4} {record['step_s']:>7.2f} {record['bytes_read'] / 1e9:>8.3f} "
            f"{record['bytes_written'] / 1e9:>10.3f} {record['io_floor_s']:>11.2f} "
            f"{record['vs_max_floor'] or 0:>11.2f} {record['peak_rss'] / GIB:>12.2f} "
            f"{record['peak_disk'] / 1e9:>12.2f} {record.get('loss', float('nan')):>7.3f}"
        )
    steady = result["steps"][1:] or result["steps"]
    if steady:
        result["median_step_s"] = statistics.median(r["step_s"] for r in steady)
        result["median_vs_max_floor"] = statistics.median(
            r["vs_max_floor"] for r in steady if r["vs_max_floor"]
        )
        print(
            f"steps after the first: median {result['median_step_s']:.2f} s, "
            f"{result['median_vs_max_floor']:.2f}x max(compute floor, I/O floor); host budget "
            f"{args.host_budget / GIB:.2f} GiB, peak RSS "
            f"{max(r['peak_rss'] for r in steady) / GIB:.2f} GiB"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compute_floor:
        shape = SHAPES[args.compute_floor].narrowed(args.narrow)
        print(json.dumps([plain_step_seconds(shape, args, n) for n in (1, 2)]))
        return 0
    logging.basicConfig(level=logging.WARNING, format="  %(name)s: %(message)s")
    parent = args.nvme_path or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    names = list(SHAPES) if args.shape == "both" else [args.shape]
    results = [run_shape(chosen(SHAPES[name], args), args, parent) for name in names]
    if args.json:
        args.json.write_text(json.dumps({"shapes": results}, indent=2))
    return 2 if any("refused" in r for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
