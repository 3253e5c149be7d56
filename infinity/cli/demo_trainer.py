"""The README's Hugging Face Trainer recipe on several ranks: each rank attaches a Llama (built
from a config, random init, nothing downloaded) to a store with the demo's budgets and trains it
with ``InfinityTrainer`` on synthetic text, Trainer's own loop doing the rest (the data sharded
across ranks, clipping at 1.0, the logged loss averaged over the ranks).

    python -m infinity.cli.demo_dist --trainer   # what `make demo-trainer` runs: 2 ranks

The flags, the launch (torchrun, gloo) and the summary per rank are those of
``python -m infinity.cli.demo_dist``; the model has the demo's --layers, --width, --vocab and
--context (4 attention heads).
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from typing import Any

import torch

from infinity.cli.common.tiny_gpt import GPTConfig, synthetic_batches
from infinity.cli.demo import (
    HEADS,
    RECORDED_STEPS,
    TEXT_VOCAB,
    learning_rate,
    rank_config,
    split_paths,
    write_rank_result,
)


def llama(args: argparse.Namespace) -> torch.nn.Module:
    """A Llama of the demo's sizes."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=args.context,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config)


def describe(args: argparse.Namespace, model: torch.nn.Module, ranks: int) -> str:
    count = sum(p.numel() for p in model.parameters())
    return (
        f"model      Llama {args.layers} layers x {args.width} wide, vocab {args.vocab}, context "
        f"{args.context}: {count / 1e6:.2f} M params; Hugging Face Trainer (InfinityTrainer) "
        f"on {ranks} ranks, AdamW lr {learning_rate(args):g}, max_grad_norm 1.0"
    )


class TextDataset(torch.utils.data.Dataset):
    """The demo's synthetic text, one sequence per example (Trainer shards them across ranks)."""

    def __init__(self, args: argparse.Namespace, count: int) -> None:
        text = synthetic_batches(
            GPTConfig(vocab_size=min(TEXT_VOCAB, args.vocab), context=args.context),
            count,
            seed=args.seed,
        )
        self.tokens, _ = next(text)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def worker(args: argparse.Namespace) -> int:
    """One rank: attach, then Trainer; writes what the summary needs to --result-dir."""
    import torch.distributed as dist
    import transformers

    from infinity import TieredStore
    from infinity.integrations.hf import InfinityTrainer

    began = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(args)
    config = rank_config(args, model, split_paths(args.nvme_path))
    store = TieredStore(config)
    record = not args.no_timeline
    outputs: dict[str, str] = {}
    losses: list[float] = []
    times: list[float] = []
    marks: dict[str, Any] = {}
    first_recorded = max(0, args.steps - RECORDED_STEPS)

    class Measure(transformers.TrainerCallback):
        """Each optimizer step's wall time and the logged loss; the timeline of the last steps."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if record and state.global_step == first_recorded:
                store.timeline.clear()
                store.timeline.enabled = True
            marks["started"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - marks["started"])

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs") or {}
            if "loss" in logs:
                losses.append(float(logs["loss"]))  # already the mean over the ranks

    try:
        model, optimizer = store.attach(
            model, torch.optim.AdamW(model.parameters(), lr=learning_rate(args))
        )
        attached = store.stats()
        with tempfile.TemporaryDirectory(prefix="infinity-demo-trainer-") as output_dir:
            trainer = InfinityTrainer(
                model=model,
                args=transformers.TrainingArguments(
                    output_dir=output_dir,
                    use_cpu=store.device.type == "cpu",
                    max_steps=args.steps,
                    per_device_train_batch_size=args.batch,
                    lr_scheduler_type="constant",
                    max_grad_norm=1.0,
                    logging_steps=1,
                    save_strategy="no",
                    report_to=[],
                    seed=args.seed,
                    train_sampling_strategy="sequential",
                    dataloader_num_workers=0,
                    disable_tqdm=rank != 0,
                ),
                train_dataset=TextDataset(args, args.steps * args.batch * world),
                optimizers=(optimizer, None),
                callbacks=[Measure()],
            )
            trainer.train()
        store.timeline.enabled = False
        stats = store.stats()
    finally:
        store.close(restore_params=False)
    write_rank_result(
        store,
        args,
        trace_name="demo-trainer-trace",
        record=record,
        losses=losses,
        times=times,
        stats=stats,
        attached=attached,
        outputs=outputs,
        began=began,
    )
    return 0
