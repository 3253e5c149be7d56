"""A parameter that autograd saves outside its module's hooks comes back with its values in
backward, under each saved-tensors hook the store installs.

TRL's fused LM head is the case seen in use: it hands ``lm_head.weight`` to an autograd Function
of its own inside the model's forward, and reads it again in that Function's backward, while the
``lm_head`` module itself never runs. Under a saved-tensors hook autograd gives that backward a
plain tensor over the parameter's storage, which is empty between uses (only the module's own
backward would fill it), so the read failed: ``setStorage ... out of bounds for storage of size
0``. Here the same shape of model trains against plain PyTorch, with the head's weight evicted
from the device tier before backward reaches it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import infinity

WIDTH, VOCAB, LAYERS = 32, 48, 4


class _HeadLogProbs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T) gathered at the targets, recomputed in backward from the
    saved weight (as a chunked LM-head kernel does)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        ctx.save_for_backward(hidden, weight, targets)
        logits = hidden @ weight.t()
        return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        probs = (hidden @ weight.t()).softmax(-1)
        onehot = torch.zeros_like(probs).scatter_(-1, targets[:, None], 1.0)
        dlogits = (onehot - probs) * grad[:, None]
        return dlogits @ weight, dlogits.t() @ hidden, None


class FusedHeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)  # its forward never runs

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return -_HeadLogProbs.apply(hidden.reshape(-1, WIDTH), self.lm_head.weight, targets).mean()


def _train(store: infinity.TieredStore | None, steps: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = FusedHeadModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if store is not None:
        model, optimizer = store.attach(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 8), generator=generator)
        targets = torch.randint(0, VOCAB, (32,), generator=generator)
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    if store is not None:
        store.close()
    return values


@pytest.mark.parametrize("activations", ["none", "cpu"])
def test_a_parameter_saved_outside_its_module_is_read_back_in_backward(tmp_path, activations):
    """``none``: the saved-activation meter's hooks on a CPU device; ``cpu``: the activation
    offload's. One block's copy fits next to another's: the head is evicted by backward."""
    expected = _train(None)
    block = (WIDTH * WIDTH + WIDTH) * 4
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        device_budget=VOCAB * WIDTH * 4 + 2 * block,
        buffer_size=8 << 10,
        offload_activations=activations,
    )
    actual = _train(infinity.TieredStore(config))
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6, msg=name)
