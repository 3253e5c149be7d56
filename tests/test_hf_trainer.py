"""Hugging Face ``transformers.Trainer`` driving a model attached to the store.

The same tiny Llama (random init: no hub download, no tokenizer) is trained twice by
``Trainer.train()`` with the same arguments and the same in-memory batches: once plainly, once
attached to a ``TieredStore`` (parameters on NVMe; gradients and optimizer state on NVMe, or in
host memory where only ``zero_grad`` drops the gradients) with the wrapped optimizer
and an LR scheduler over it passed as ``Trainer(..., optimizers=(optimizer, scheduler))``.
Trainer clips with ``max_grad_norm`` through ``accelerator.clip_grad_norm_`` ->
``torch.nn.utils.clip_grad_norm_(model.parameters())`` (it reads and scales ``p.grad``), clears
with ``model.zero_grad()`` (never ``optimizer.zero_grad()``) and accumulates gradients over two
micro-batches per step. Every logged loss (within 1e-5) and gradient norm (within 1e-5
relative) and the final parameters must match the plain run's.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it (transformers' "torch" extra)

import infinity  # noqa: E402
from tests.test_transformers import CONTEXT, NVME, VOCAB, llama  # noqa: E402

BATCH, ACCUMULATE, STEPS, LR, MAX_GRAD_NORM = 4, 2, 10, 1e-2, 1.0


class CountingSequences(torch.utils.data.Dataset):
    """Counting sequences (each token the previous plus a per-sequence stride, mod the
    vocabulary) from random starts, fixed at construction: one example per micro-batch row."""

    def __init__(self, count: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (count, 1), generator=generator)
        stride = torch.randint(1, 4, (count, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(CONTEXT)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def arguments(output_dir) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        seed=0,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        max_grad_norm=MAX_GRAD_NORM,
        # Unused: the optimizer and the scheduler are ours (optimizers=...).
        learning_rate=LR,
        weight_decay=0.1,
        logging_strategy="steps",
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        # Identical batches in both runs, in dataset order, in this process.
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        # Nothing that changes numerics or wraps the model: fp32, no compile, no tf32.
        bf16=False,
        fp16=False,
        tf32=None,
        torch_compile=False,
    )


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # fused: what the store runs for default-options AdamW; the plain run uses the same kernel.
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)


def schedule(optimizer: torch.optim.Optimizer):
    return transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=2, num_training_steps=STEPS
    )


def train(model, optimizer, output_dir) -> tuple[list[float], list[float], list[float]]:
    """Trainer.train() with our optimizer and scheduler; returns the logged loss, grad_norm and
    learning_rate of every optimizer step."""
    trainer = transformers.Trainer(
        model=model,
        args=arguments(output_dir),
        train_dataset=CountingSequences(BATCH * ACCUMULATE * STEPS),
        optimizers=(optimizer, schedule(optimizer)),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == list(range(1, STEPS + 1)), logs
    return (
        [e["loss"] for e in logs],
        [e["grad_norm"] for e in logs],
        [e["learning_rate"] for e in logs],
    )


pytestmark = pytest.mark.usefixtures("one_thread")


# Gradients on NVMe are consumed by the step; in host memory ("cpu") they stay until cleared, and
# Trainer clears them only with model.zero_grad().
@pytest.mark.parametrize("offload_optimizer", ["nvme", "cpu"])
def test_trainer_with_clipping_and_accumulation_matches_plain_run(tmp_path, offload_optimizer):
    reference = llama()
    plain = copy.deepcopy(reference)
    plain_losses, plain_norms, plain_lrs = train(plain, adamw(plain), tmp_path / "plain")

    # The run is worth comparing: losses finite and falling, clipping at work (the logged norm
    # is the one before clipping), the warmup-then-linear schedule applied.
    assert all(math.isfinite(x) for x in plain_losses)
    assert plain_losses[-1] < plain_losses[0] - 0.15, plain_losses
    assert max(plain_norms) > MAX_GRAD_NORM, plain_norms
    expected_lrs = [LR * s / 2 if s < 2 else LR * (STEPS - s) / (STEPS - 2) for s in range(STEPS)]
    assert plain_lrs == pytest.approx(expected_lrs)

    attached = copy.deepcopy(reference)
    config = infinity.OffloadConfig(
        nvme_path=str(tmp_path), **{**NVME, "offload_optimizer": offload_optimizer}
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(attached, adamw(attached))
        losses, norms, lrs = train(model, optimizer, tmp_path / "attached")
        state = model.state_dict()
        stats = store.stats()

    assert stats["steps"] == STEPS
    assert lrs == pytest.approx(plain_lrs)
    # The norm Trainer logs is clip_grad_norm_'s over model.parameters(): the store's gradients.
    for step, (a, b) in enumerate(zip(plain_norms, norms)):
        assert b == pytest.approx(a, rel=1e-5), f"step {step + 1}: grad_norm {b} vs plain {a}"
    for step, (a, b) in enumerate(zip(plain_losses, losses)):
        assert abs(a - b) <= 1e-5, f"step {step + 1}: loss {b} vs plain {a}"
    plain_state = plain.state_dict()
    assert plain_state.keys() == state.keys()
    for key in plain_state:
        torch.testing.assert_close(
            state[key], plain_state[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
        )
