"""What the store's hooks keep alive: nothing of a step outlives it.

The frozen parameters' input hooks once formed a cycle through autograd's C++ nodes that
Python's collector cannot see. Under activation checkpointing each step's recomputed inputs and
graph stayed alive, and a 13 B LoRA's peak RSS grew by 60 MB a step at six layers. Each test
records weak references to the tensors a frozen layer is called with (in forward and in the
recomputation) and checks that none survives its step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity


class FrozenBaseBlock(nn.Module):
    """A frozen Linear with a trained adapter beside it, as LoRA adapts a base layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.adapter = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.tanh(self.base(h) + self.adapter(h))


class CheckpointedStack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3, mode: str = "non_reentrant") -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(FrozenBaseBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            if self.mode == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


def watch_inputs(model: CheckpointedStack) -> list[weakref.ref]:
    """Weak references to every tensor a frozen base layer is called with, from now on."""
    seen: list[weakref.ref] = []

    def record(module: nn.Module, args: tuple) -> None:
        seen.extend(weakref.ref(a) for a in args if isinstance(a, torch.Tensor))

    for module in model.modules():
        if isinstance(module, FrozenBaseBlock):
            module.base.register_forward_pre_hook(record)
    return seen


def alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "none"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_no_input_of_a_frozen_layer_outlives_its_step(tmp_path, mode, offload):
    torch.manual_seed(0)
    model = CheckpointedStack(mode=mode)
    seen = watch_inputs(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    paths = {"nvme_path": str(tmp_path)} if offload == "nvme" else {}
    config = infinity.OffloadConfig(
        offload_param=offload, offload_optimizer=offload, host_budget="64MiB", **paths
    )
    store = infinity.TieredStore(config)
    try:
        model, optimizer = store.attach(model, optimizer)
        batches = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(4)]
        for x, y in batches:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            del loss
            # three frozen layers, each called in forward and again in a recomputation
            assert len(seen) == (6 if mode != "none" else 3)
            assert alive(seen) == 0, f"{alive(seen)} of the step's inputs are still alive"
            seen.clear()
        # a forward with gradients on whose backward never comes (an evaluation that forgot
        # no_grad): its inputs go once the next iteration starts
        model(batches[0][0])
        assert len(seen) == 3
        x, y = batches[1]
        model(x)  # the next iteration
        assert alive(seen[:3]) == 0
    finally:
        store.close()


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_a_checkpointed_hf_lora_model_keeps_no_step_alive(tmp_path):
    """The shape that found it: peft's LoRA on a Hugging Face Llama, with gradient
    checkpointing (non-reentrant) turned on after attach, as Trainer does. Before the fix a
    recomputed tensor and 15 hooks were left behind by every step."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=16,
        attn_implementation="sdpa",
    )
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path),
            host_budget="64MiB",
            precision=infinity.PrecisionConfig(dtype="bf16", storage_dtype="bf16"),
        )
    )
    try:
        model, optimizer = store.attach(model, optimizer)
        model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
        counts = []
        for _ in range(6):
            tokens = torch.randint(0, 64, (1, 16))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            counts.append(live_tensors())
        # The first steps record the trace and decide where updates run; from the third on a
        # step leaves what the one before left (before the fix, one tensor more each step).
        assert counts[2:] == [counts[2]] * 4, f"live tensors after each step: {counts}"
    finally:
        store.close()
