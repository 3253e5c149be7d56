"""Programs written the way users write them, for tests/test_real_clients.py: seed once at the
top, build the model, (attach,) then draw batches, dropout masks and evaluation batches from the
global random streams. Each program runs with the store or without it and returns what it
logged, so a test can hold the two side by side."""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import infinity


def rng_state() -> tuple[Any, ...]:
    """Every global random stream a training program draws from: torch's CPU generator (and
    CUDA's where initialised), Python's ``random`` and numpy's global state."""
    cuda: list[Any] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    kind, keys, position, gauss, cached = np.random.get_state()
    return (
        torch.get_rng_state().tolist(),
        cuda,
        random.getstate(),
        (kind, keys.tolist(), position, gauss, cached),
    )


# -- a GPT as nanoGPT's model.py writes it (smaller) ------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)
        self.heads = heads
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        x = x + self.resid_dropout(self.proj(y))
        return x + self.resid_dropout(self.fc_proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, context: int, width: int, layers: int, heads: int, dropout: float
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT does
        for name, p in self.named_parameters():
            if name.endswith("fc_proj.weight") or name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1])
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


#: the model and loop: state ~16x the fp32 parameters, against a store whose arena is a few
#: buffers, so every step reads and writes its shards from NVMe
SIZES = {"vocab": 512, "context": 32, "width": 96, "layers": 2, "heads": 4, "dropout": 0.1}
BATCH, ACCUMULATE, CLIP, LR = 4, 2, 1.0, 3e-3


def store_config(nvme: Path, **changes: Any) -> infinity.OffloadConfig:
    """Masters, gradients and Adam state on NVMe under a host budget, through an arena of a few
    64 KiB buffers (the wte/lm_head weight is three of them)."""
    settings: dict[str, Any] = dict(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(nvme),
        host_budget="36MiB",
        buffer_size="64KiB",
        buffer_count=8,
        device="cpu",
    )
    settings.update(changes)
    return infinity.OffloadConfig(**settings)


def nanogpt(
    nvme: Path | None,
    iterations: int,
    resume: dict[str, Any] | None = None,
    data_seed: int = 1337,
) -> dict[str, Any]:
    """nanoGPT's train.py in miniature: ``torch.manual_seed`` once at the top, the model built,
    AdamW from its parameters, (the two attach lines,) then ``get_batch`` drawing offsets with
    ``torch.randint`` from the global stream, dropout 0.1, gradient accumulation, clipping, an
    evaluation every 2 iterations under ``torch.no_grad`` (``model.eval()``: its own batches
    from the same stream). ``resume``: the checkpoint dict an earlier run returned (its model
    and optimizer state dicts, loaded as nanoGPT loads them); returns the logged losses, the
    evaluations and a checkpoint dict."""
    torch.manual_seed(data_seed)
    data = torch.arange(20_000) * 7 % SIZES["vocab"]  # a learnable "corpus"
    model = GPT(**SIZES)
    start = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        start = resume["iteration"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    store = None
    if nvme is not None:
        store = infinity.TieredStore(store_config(nvme))
        model, optimizer = store.attach(model, optimizer)
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - SIZES["context"], (BATCH,))
        x = torch.stack([data[i : i + SIZES["context"]] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + SIZES["context"]] for i in ix])
        return x, y

    losses: list[float] = []
    evaluations: list[float] = []
    try:
        for iteration in range(start, start + iterations):
            if iteration % 2 == 0:
                model.eval()
                with torch.no_grad():
                    evaluations.append(float(model(*get_batch())))
                model.train()
            for _ in range(ACCUMULATE):
                loss = model(*get_batch()) / ACCUMULATE
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item() * ACCUMULATE)
        checkpoint = {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "iteration": start + iterations,
        }
        read = store.stats()["bytes_read"] if store is not None else 0
    finally:
        if store is not None:
            store.close()
    return {"loss": losses, "eval": evaluations, "checkpoint": checkpoint, "bytes_read": read}


def attach_snippet(config: dict[str, Any] | None) -> list[float]:
    """The issue's snippet: seed, build, AdamW, attach (``config`` None: without the store), then
    one draw from each global stream."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    with tempfile.TemporaryDirectory() as nvme:
        store = None
        if config is not None:
            store = infinity.TieredStore(
                infinity.OffloadConfig(nvme_path=nvme, device="cpu", **config)
            )
            model, optimizer = store.attach(model, optimizer)
        drawn = torch.rand(3).tolist() + [random.random(), float(np.random.rand())]
        if store is not None:
            store.close()
    return drawn


def nanogpt_with_resume(nvme: str | None) -> dict[str, Any]:
    """Six iterations, then four more resumed from the state dicts the first run saved (a new
    launch: seeded again at the top, as nanoGPT's script is)."""
    first = nanogpt(Path(nvme) if nvme else None, 6)
    resumed = nanogpt(Path(nvme) if nvme else None, 4, resume=first["checkpoint"])
    return {
        "loss": first["loss"],
        "eval": first["eval"],
        "resumed_loss": resumed["loss"],
        "resumed_eval": resumed["eval"],
        "bytes_read": first["bytes_read"],
    }
