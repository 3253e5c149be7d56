"""A small GPT-style language model defined here, for the demo, tests and benchmarks.

Pre-norm transformer blocks (causal self-attention + MLP), learned positions, a language-model
head tied to the token embedding. Random init, no downloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 64
    layers: int = 8
    width: int = 64
    heads: int = 4
    dropout: float = 0.0
    checkpoint_blocks: bool = False


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.norm2 = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.out = nn.Linear(4 * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.out(F.gelu(self.fc(self.norm2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            if self.config.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def parameter_count(config: GPTConfig) -> int:
    w = config.width
    block = 4 * w + 3 * w * w + 3 * w + w * w + w + 4 * w * w + 4 * w + 4 * w * w + w
    return config.vocab_size * w + config.context * w + config.layers * block + 2 * w


def synthetic_batches(config: GPTConfig, batch: int, seed: int = 0, rule_seed: int | None = None):
    """An endless stream of (tokens, targets) from a fixed random text with learnable structure:
    each next token is a deterministic function of the previous two, plus noise.

    ``seed`` draws the rule and the text; with ``rule_seed`` the rule is drawn from that instead,
    so a stream with another ``seed`` and the same ``rule_seed`` is held-out text of the same
    language (the rule of ``seed=rule_seed``)."""
    generator = torch.Generator().manual_seed(seed)
    rules = generator if rule_seed is None else torch.Generator().manual_seed(rule_seed)
    vocab = config.vocab_size
    table = torch.randint(0, vocab, (vocab, vocab), generator=rules)
    while True:
        seq = torch.empty(batch, config.context + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, vocab, (batch, 2), generator=generator)
        for t in range(2, config.context + 1):
            seq[:, t] = table[seq[:, t - 2], seq[:, t - 1]]
        noise = torch.rand(seq.shape, generator=generator) < 0.05
        seq[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


__all__ = ["Block", "GPTConfig", "TinyGPT", "math", "parameter_count", "synthetic_batches"]
