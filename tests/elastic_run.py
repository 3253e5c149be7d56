"""One rank of the elastic test's job (tests/test_elastic.py), launched by torchrun: the
README's elastic recipe on a small GPT with dropout, parameters and Adam state on NVMe, a
DistributedSampler over a fixed data set, an LR scheduler, and an asynchronous checkpoint every
--every steps. With --kill-rank/--kill-step that rank SIGKILLs itself at that step in the job's
first attempt only: between forward and backward, or, at a step that saves a checkpoint, from
its writer thread half-way through writing it. Each rank writes what the test checks
into --out: its final parameters, where it resumed from, and what nvme_path held at the end."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import infinity
import infinity.checkpointing.storage
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT

MODEL = GPTConfig(vocab_size=64, context=16, layers=4, width=32, heads=4, dropout=0.1)
SEQUENCES = 32  # the data set; each rank takes BATCH of them per step
BATCH = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--nvme", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=args.nvme,
            buffer_size=8192,
            buffer_count=8,
            device="cpu",
        )
    )
    model, optimizer = store.attach(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = torch.randint(
        0,
        MODEL.vocab_size,
        (SEQUENCES, MODEL.context + 1),
        generator=torch.Generator().manual_seed(1),
    )
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    per_epoch = len(sampler) // BATCH
    torch.manual_seed(100 + rank)  # each rank's dropout: its RNG state is in the checkpoint

    # -- the recipe: resume from the newest complete checkpoint, if there is one ---------------
    start, resumed_from = 0, None
    found = sorted(os.listdir(args.checkpoints)) if args.checkpoints.exists() else []
    latest = store.latest_checkpoint(args.checkpoints)
    if latest is not None:
        position = store.load_checkpoint(latest)
        scheduler.load_state_dict(position["scheduler"])
        start, resumed_from = position["step"], latest.name

    for step in range(start, args.steps):
        dies_now = attempt == 0 and rank == args.kill_rank and step == args.kill_step
        if step > start and step % args.every == 0:  # not the one just loaded again
            if dies_now:
                _die_while_writing()
            store.save_checkpoint(
                args.checkpoints / f"step-{step}",
                extra={"step": step, "scheduler": scheduler.state_dict()},
                async_save=True,
            )
        epoch, batch = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        indices = list(sampler)[batch * BATCH : (batch + 1) * BATCH]
        sequences = data[indices]
        loss = model(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())
        if dies_now:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    store.wait_for_checkpoint()

    state = {k: v.clone() for k, v in model.state_dict().items()}
    nvme_holds = sorted(os.listdir(args.nvme))
    own = sorted(d.name for d in store.engine.space.run_dirs)
    dist.barrier()  # every rank has looked before any removes its own
    store.close()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.out / f"params-{rank}.pt")
    report = {
        "attempt": attempt,
        "start": start,
        "resumed_from": resumed_from,
        "found": found,
        "nvme_holds": nvme_holds,
        "own": own,
    }
    (args.out / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _die_while_writing() -> None:
    """SIGKILL from the checkpoint's writer thread at its third chunk: a rank killed while its
    part of a checkpoint is half written."""
    real = infinity.checkpointing.storage.tensor_bytes
    chunks = [0]

    def dying(tensor: torch.Tensor) -> memoryview:
        chunks[0] += 1
        if chunks[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tensor)

    infinity.checkpointing.storage.tensor_bytes = dying


if __name__ == "__main__":
    main()
