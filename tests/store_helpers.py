"""Shared pieces of the store tests: a reference run and an attached run of the same loop."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

import infinity
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

SMALL = GPTConfig(vocab_size=64, context=16, layers=8, width=32, heads=4)


def make_model(config: GPTConfig = SMALL, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(config)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    micro_batches: int = 1,
    scheduler_factory: Callable | None = None,
    config: GPTConfig = SMALL,
    batch: int = 4,
    seed: int = 1,
    after_backward: Callable[[torch.nn.Module], object] | None = None,
) -> list[float]:
    """The loop; ``after_backward(model)`` runs before each optimizer.step() (clipping, norm
    logging), as a trainer's would."""
    data = synthetic_batches(config, batch, seed=seed)
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(micro_batches):
            tokens, targets = next(data)
            loss = model(tokens, targets) / micro_batches
            loss.backward()
            total += loss.item()
        if after_backward is not None:
            after_backward(model)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


def fused_adamw(params):
    """AdamW on torch's fused CPU kernel: what the store runs for a default-options AdamW."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)


def default_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def compare(
    reference: torch.nn.Module,
    steps: int,
    config_kwargs: dict,
    *,
    optimizer_factory: Callable | None = None,
    plain_factory: Callable | None = None,
    tmp_path=None,
    **train_kwargs,
):
    """Trains a copy of ``reference`` plainly and attached; returns both losses, both final
    state dicts and the store's stats."""
    optimizer_factory = optimizer_factory or fused_adamw
    plain_factory = plain_factory or optimizer_factory
    plain = copy.deepcopy(reference)
    plain_losses = train(plain, plain_factory(plain.parameters()), steps, **train_kwargs)
    attached = copy.deepcopy(reference)
    if tmp_path is not None and config_kwargs.get("offload_param", "nvme") == "nvme":
        config_kwargs = {"nvme_path": str(tmp_path), **config_kwargs}
    store = infinity.TieredStore(infinity.OffloadConfig(**config_kwargs))
    model, optimizer = store.attach(attached, optimizer_factory(attached.parameters()))
    losses = train(model, optimizer, steps, **train_kwargs)
    stats = store.stats()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    store.close()
    return plain_losses, losses, plain.state_dict(), state, stats


def assert_equivalent(plain_losses, losses, plain_state, state, loss_tol=1e-5):
    assert len(plain_losses) == len(losses)
    for step, (a, b) in enumerate(zip(plain_losses, losses)):
        assert abs(a - b) <= loss_tol, f"step {step}: loss {b} vs plain {a}"
    assert plain_state.keys() == state.keys()
    for key in plain_state:
        torch.testing.assert_close(
            state[key], plain_state[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
        )
