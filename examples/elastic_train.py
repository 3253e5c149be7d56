"""Elastic training: when a rank dies, torchrun restarts every rank and the job continues from
its newest complete checkpoint, replaying exactly what the lost steps did. The demo's GPT
(``make demo``'s sizes), parameters and Adam state on NVMe, an LR scheduler, a
DistributedSampler with shuffling, dropout; an asynchronous checkpoint every --every steps.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 3 examples/elastic_train.py --kill-at 25
    python examples/elastic_train.py          # one process: run it again and it resumes

--kill-at STEP makes the last rank SIGKILL itself at that step in the first attempt, to watch a
restart. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a rendezvous store of its own
(on the store torchrun shares by default, restarted ranks can read the dead attempt's
addresses and fail to connect). Checkpoints go to --out/checkpoints/step-<n>, swap files to
--out/swap (a path that stays the same across restarts, so the next attempt reclaims the dead
ranks' swap files). At the end rank 0 prints what each save cost.
"""

import argparse
import datetime
import logging
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

MODEL = GPTConfig(vocab_size=512, context=64, layers=8, width=256, heads=4, dropout=0.1)
BATCH = 8  # sequences per rank and step
SEQUENCES = 1024  # the data set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--out", type=Path, default=Path("elastic-out"))
    parser.add_argument("--kill-at", type=int, default=-1, metavar="STEP")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("infinity.checkpointing.latest").setLevel(logging.INFO)

    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    checkpoints = args.out / "checkpoints"
    swap = args.out / "swap"
    swap.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=swap,
            host_budget="64MiB",
            device="cpu",
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=2e-3))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    stream = synthetic_batches(MODEL, SEQUENCES, seed=1)
    tokens, targets = next(stream)
    sampler = DistributedSampler(tokens, num_replicas=world, rank=rank, shuffle=True, seed=0)
    per_epoch = len(sampler) // BATCH
    torch.manual_seed(1000 + rank)  # this rank's dropout; the checkpoint keeps its RNG state

    # Resume: the newest complete checkpoint (None at the job's first start). Load it after
    # the scheduler is made, as with plain torch: making one changes the learning rate.
    start = 0
    latest = store.latest_checkpoint(checkpoints)
    if latest is not None:
        position = store.load_checkpoint(latest)
        scheduler.load_state_dict(position["scheduler"])
        start = position["step"]

    costs = SaveCosts(store)
    for step in range(start, args.steps):
        started = time.perf_counter()
        if step > start and step % args.every == 0:
            call = time.perf_counter()
            store.save_checkpoint(
                checkpoints / f"step-{step}",
                # the data position: the step (the epoch and the place in it follow from it)
                extra={"step": step, "scheduler": scheduler.state_dict()},
                async_save=True,
            )
            costs.saved(time.perf_counter() - call)
        epoch, index = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        batch = list(sampler)[index * BATCH : (index + 1) * BATCH]
        loss = model(tokens[batch], targets[batch])
        if attempt == 0 and step == args.kill_at and rank == world - 1:
            print(f"rank {rank}: killed at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        costs.stepped(time.perf_counter() - started)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.3f}", flush=True)
    store.wait_for_checkpoint()
    costs.stepped(None)
    if rank == 0 and costs.calls:
        print(f"attempt {attempt}: {costs.summary()}", flush=True)
    store.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class SaveCosts:
    """What the asynchronous checkpoints cost this rank: the save call, the writing in the
    background, the steps' waits for it, and the steps while a save was written against the
    others. A save's figures (``store.last_checkpoint``) change when its writing ends."""

    def __init__(self, store: infinity.TieredStore) -> None:
        self.store = store
        self.calls: list[float] = []
        self.writes: list[float] = []
        self.waits: list[float] = []
        self.while_writing: list[float] = []
        self.others: list[float] = []
        self.writing = False
        self.figures = store.last_checkpoint

    def saved(self, call_seconds: float) -> None:
        self._collect()  # the previous save, which this one waited for
        self.calls.append(call_seconds)
        self.writing = True

    def stepped(self, seconds: float | None) -> None:
        if seconds is not None:
            (self.while_writing if self.writing else self.others).append(seconds)
        self._collect()

    def _collect(self) -> None:
        figures = self.store.last_checkpoint
        if self.writing and figures != self.figures:
            self.writing, self.figures = False, figures
            self.writes.append(figures["save_seconds"])
            self.waits.append(figures["step_wait_seconds"])

    def summary(self) -> str:
        megabytes = self.figures["bytes_written"] / 1e6
        median = statistics.median
        return (
            f"{len(self.calls)} checkpoint(s) of {megabytes:.1f} MB per rank; per save "
            f"{statistics.mean(self.calls):.3f} s in the call, written in "
            f"{statistics.mean(self.writes):.2f} s in the background, the steps waited "
            f"{statistics.mean(self.waits):.3f} s for it; a step took "
            f"{median(self.while_writing):.3f} s while a save was written, "
            f"{median(self.others or [float('nan')]):.3f} s otherwise"
        )


if __name__ == "__main__":
    main()
