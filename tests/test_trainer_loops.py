"""An attached model in a nanoGPT-style loop, as a user runs it: gradient accumulation, a
learning-rate warm-up written into param_groups, clip_grad_norm_, gradient-norm and weight-norm
logging, an EMA of the weights updated after every step, evaluation under model.eval() and
no_grad; every logged number and the EMA equal the plain loop's."""

from __future__ import annotations

import copy
import math

import torch

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from tests.store_helpers import SMALL, make_model


def _loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    iterations: int = 5,
    rank: int | None = None,
    world: int = 1,
):
    """The loop; with ``rank``, that rank's half of each batch under torch.distributed (the
    logged loss is then the mean over the ranks)."""
    data = synthetic_batches(SMALL, 4, seed=1)
    probe = next(synthetic_batches(SMALL, 4, seed=9))
    ema = [p.detach().clone() for p in model.parameters()]
    log = []
    for iteration in range(iterations):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 * min(1.0, (iteration + 1) / 3)
        for _ in range(2):
            tokens, targets = next(data)
            if rank is not None:
                share = 4 // world
                tokens = tokens[rank * share : (rank + 1) * share]
                targets = targets[rank * share : (rank + 1) * share]
            loss = model(tokens, targets) / 2
            loss.backward()
        logged = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for average, param in zip(ema, model.parameters()):
                average.mul_(0.9).add_(param.detach(), alpha=0.1)
            weights = math.sqrt(sum(float(p.norm()) ** 2 for p in model.parameters()))
        model.eval()
        with torch.no_grad():
            evaluation = float(model(*probe))
        model.train()
        loss = loss.detach()
        if rank is not None:
            torch.distributed.all_reduce(loss)
            loss /= world
        log.append((loss.item(), float(norm), logged, weights, evaluation))
    return log, ema


def test_nanogpt_style_loop_attached_equals_plain(tmp_path):
    plain = make_model()
    attached = copy.deepcopy(plain)
    plain_log, plain_ema = _loop(
        plain, torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    )
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=8 << 10,
        buffer_count=8,
        nvme_path=str(tmp_path),
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(
            attached, torch.optim.AdamW(attached.parameters(), lr=1e-3, weight_decay=0.1)
        )
        log, ema = _loop(model, optimizer)
        assert store.stats()["bytes_read"] > 0
    for step, (expected, got) in enumerate(zip(plain_log, log)):
        for a, b in zip(expected, got):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7), (step, expected, got)
    assert min(norm for _, norm, *_ in plain_log) > 0.5  # every step was clipped
    for a, b in zip(plain_ema, ema):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_an_ema_model_from_deepcopy_trains_and_evaluates_like_plain(tmp_path):
    """torch's AveragedModel (and timm's ModelEma) deep-copy the model: the copy is an ordinary
    model with the values of the moment (the store's hooks it carries do nothing on it), and
    its average follows the attached parameters as it follows plain ones."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        data = synthetic_batches(SMALL, 4, seed=1)
        probe = next(synthetic_batches(SMALL, 4, seed=9))
        for _ in range(3):
            model(*next(data)).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
        with torch.no_grad():
            return float(ema(*probe)), {k: v.clone() for k, v in ema.state_dict().items()}

    plain = make_model()
    attached = copy.deepcopy(plain)
    plain_loss, plain_state = run(plain, torch.optim.AdamW(plain.parameters(), fused=True))
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=8 << 10,
        buffer_count=8,
        nvme_path=str(tmp_path),
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(attached, torch.optim.AdamW(attached.parameters()))
        loss, state = run(model, optimizer)
        assert store.stats()["trace_departures"] == 0  # the copy's forward is not traced
    assert loss == plain_loss
    for key, value in plain_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-7)


def _nanogpt_on_rank(rank: int, world: int, swap_root: str):
    model = make_model(seed=rank)  # rank 0's values are the ones all ranks start from
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=8 << 10,
        buffer_count=8,
        nvme_path=swap_root,
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        )
        return _loop(model, optimizer, rank=rank, world=world)


def test_nanogpt_style_loop_on_two_ranks_equals_one_plain_process(tmp_path):
    from tests.dist_helpers import run_ranks

    plain = make_model()
    plain_log, plain_ema = _loop(
        plain, torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    )
    results = run_ranks(_nanogpt_on_rank, 2, str(tmp_path), timeout=240)
    for rank, (log, ema) in results.items():
        for step, (expected, got) in enumerate(zip(plain_log, log)):
            for a, b in zip(expected, got):
                # Sums over the ranks' halves: another order of additions than one batch.
                assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (rank, step, expected, got)
        for a, b in zip(plain_ema, ema):
            torch.testing.assert_close(torch.as_tensor(b), a, rtol=1e-4, atol=1e-5)
