"""Attached parameters outside forward: no crash, reads as they are, writes through
``store.gathered(..., modify=True)``, freezing (LoRA-style fine-tuning)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from infinity.errors import BudgetError, ParameterAccessError
from swap import align_up
from tests.store_helpers import SMALL, fused_adamw, make_model, train

ROOT = Path(__file__).resolve().parents[1]
NVME = {
    "offload_param": "nvme",
    "offload_optimizer": "nvme",
    "buffer_size": 8 << 10,
    "buffer_count": 8,
}
CPU = {"offload_param": "cpu", "offload_optimizer": "cpu"}

# Each op of the table after attach (params on nvme, then on cpu), in one fresh process that
# runs them in turn, each on a store and a model of its own: the child prints one JSON line per
# op and config, or dies, which is what the tests look for.
_CHILD = textwrap.dedent("""
    import copy, json, sys, tempfile
    import torch
    import infinity
    from tests.store_helpers import SMALL, fused_adamw, make_model
    from infinity.cli.common.tiny_gpt import synthetic_batches

    # Updates in optimizer.step(): clip_grad_value reads gradients the first step did not.
    configs = {"nvme": dict(offload_param="nvme", offload_optimizer="nvme", buffer_size=8192,
                            buffer_count=8, nvme_path=tempfile.mkdtemp(),
                            step_in_backward=False),
               "cpu": dict(offload_param="cpu", offload_optimizer="cpu",
                           step_in_backward=False)}
    for op in sys.argv[1:]:
        for name, config in configs.items():
            plain = make_model()
            model = copy.deepcopy(plain)
            store = infinity.TieredStore(infinity.OffloadConfig(**config))
            model, optimizer = store.attach(model, fused_adamw(model.parameters()))
            tokens, targets = next(synthetic_batches(SMALL, 4, seed=1))
            model(tokens, targets).backward()          # one step in: values moved, then read
            optimizer.step(); optimizer.zero_grad()
            plain_optimizer = fused_adamw(plain.parameters())
            plain(tokens, targets).backward(); plain_optimizer.step(); plain_optimizer.zero_grad()
            weight, plain_weight = model.embed.weight, plain.embed.weight
            out = {}
            try:
                if op == "sum":
                    out["equal"] = bool(weight.sum() == plain_weight.sum())
                elif op == "ema":
                    ema = torch.zeros_like(plain_weight)
                    ema.copy_(weight)
                    out["equal"] = torch.equal(ema, plain_weight.detach())
                elif op == "parameters_to_vector":
                    vector = torch.nn.utils.parameters_to_vector(model.parameters())
                    out["equal"] = torch.equal(
                        vector, torch.nn.utils.parameters_to_vector(plain.parameters()))
                elif op == "print":
                    out["equal"] = repr(weight) == repr(plain_weight)
                elif op == "requires_grad":
                    weight.requires_grad_(False)
                    out["equal"] = weight.requires_grad is False and \\
                        weight.shape == plain_weight.shape and weight.dtype == plain_weight.dtype
                elif op == "clip_grad_value":
                    model(tokens, targets).backward(); plain(tokens, targets).backward()
                    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
                    torch.nn.utils.clip_grad_value_(plain.parameters(), 1e-3)
                    out["equal"] = all(torch.equal(a.grad.clone(), b.grad) for a, b in
                                       zip(model.parameters(), plain.parameters()))
                elif op == "data_zero":
                    weight.data.zero_()
                elif op == "vector_to_parameters":
                    vector = torch.nn.utils.parameters_to_vector(plain.parameters()) * 2
                    torch.nn.utils.vector_to_parameters(vector, model.parameters())
                out["raised"] = None
            except infinity.InfinityError as exc:
                out["raised"] = type(exc).__name__
            # The same write inside gathered(modify=True) takes effect.
            if op in ("data_zero", "vector_to_parameters"):
                with store.gathered(modify=True):
                    if op == "data_zero":
                        weight.data.zero_()
                    else:
                        torch.nn.utils.vector_to_parameters(vector, model.parameters())
                with torch.no_grad():
                    if op == "data_zero":
                        plain_weight.data.zero_()
                    else:
                        torch.nn.utils.vector_to_parameters(vector, plain.parameters())
                state, plain_state = model.state_dict(), plain.state_dict()
                out["equal"] = all(torch.equal(state[k], plain_state[k]) for k in plain_state) \\
                    and torch.equal(model(tokens, targets), plain(tokens, targets))
            store.close()
            print(json.dumps({"op": op, "config": name, **out}), flush=True)
""")

READS = ["sum", "ema", "parameters_to_vector", "print", "requires_grad", "clip_grad_value"]
WRITES = ["data_zero", "vector_to_parameters"]


@pytest.fixture(scope="module")
def child_results() -> tuple[subprocess.CompletedProcess, dict[tuple[str, str], dict]]:
    """One fresh process runs every op; the lines it printed, by (op, config)."""
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, *READS, *WRITES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return result, {(line["op"], line["config"]): line for line in lines}


@pytest.mark.parametrize("op", READS + WRITES)
def test_each_op_outside_forward_in_a_fresh_process(op, child_results):
    result, lines = child_results
    for config in ("nvme", "cpu"):
        assert (op, config) in lines, (
            f"{op} on {config}: the child printed nothing for it; exit {result.returncode} "
            f"(a negative code is a signal)\n{result.stderr[-3000:]}"
        )
        line = lines[op, config]
        assert line["equal"] is True, line
        assert line["raised"] == ("ParameterAccessError" if op in WRITES else None), line


def test_the_process_that_ran_the_ops_exits_cleanly(child_results):
    result, _ = child_results
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"


def test_writes_inside_gathered_take_effect_and_training_continues_like_plain(tmp_path):
    reference = make_model()
    plain = copy.deepcopy(reference)
    plain_optimizer = fused_adamw(plain.parameters())
    attached = copy.deepcopy(reference)
    store = infinity.TieredStore(infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path)))
    model, optimizer = store.attach(attached, fused_adamw(attached.parameters()))

    def edit(m: nn.Module) -> None:
        torch.manual_seed(5)
        nn.init.normal_(m.blocks[1].fc.weight, std=0.01)  # re-initialise a layer
        m.blocks[2].fc.bias.zero_()
        m.norm.weight[:4] = 2.0  # part of a parameter
        m.blocks[0].fc.weight.data.mul_(0.5)  # through .data

    try:
        plain_losses = train(plain, plain_optimizer, 2)
        losses = train(model, optimizer, 2)
        with torch.no_grad():
            edit(plain)
        with pytest.raises(ParameterAccessError, match="store.gathered"), torch.no_grad():
            edit(model)
        with store.gathered(model.parameters(), modify=True), torch.no_grad():
            edit(model)
        state, plain_state = model.state_dict(), plain.state_dict()
        for key in plain_state:
            assert torch.equal(state[key], plain_state[key]), key
        plain_losses += train(plain, plain_optimizer, 3, seed=2)
        losses += train(model, optimizer, 3, seed=2)
        assert losses == plain_losses
        state, plain_state = model.state_dict(), plain.state_dict()
        for key in plain_state:
            assert torch.equal(state[key], plain_state[key]), key
    finally:
        store.close()


def test_gathered_read_only_and_its_errors(tmp_path):
    model = make_model()
    config = infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path), device_budget=64 << 10)
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        block = model.blocks[0]
        with store.gathered(block.parameters()):
            total = block.fc.weight.detach().sum().item()  # live: on the device copy
            with pytest.raises(ParameterAccessError, match="modify=True"):
                block.fc.weight.zero_()
        assert block.fc.weight.detach().sum().item() == total
        with pytest.raises(BudgetError, match="pass fewer"):
            with store.gathered():  # the whole model: over the budget
                pass
        with pytest.raises(ParameterAccessError, match="parameters of the attached model"):
            with store.gathered([torch.zeros(3)]):
                pass
        # Every write the store had started or had yet to start (the values written after
        # attach, evictions) lands first, and a write-back would land before the second count.
        store.placement.flush()
        before = store.stats()["bytes_written"]
        with store.gathered(block.parameters(), modify=True):
            pass  # nothing changed: nothing written
        store.placement.flush()
        assert store.stats()["bytes_written"] == before
        assert not store.placement.audit()


def test_views_outside_forward_are_read_only_snapshots(tmp_path):
    model = make_model()
    with infinity.TieredStore(infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path))) as store:
        model, _ = store.attach(model, fused_adamw(model.parameters()))
        weight = model.blocks[0].fc.weight
        row = weight[0]
        assert torch.equal(row, weight.detach().clone()[0])
        with pytest.raises(ParameterAccessError, match="copy, not the store"):
            row.fill_(1.0)
        with pytest.raises(ParameterAccessError, match="copy, not the store"):
            weight.view(-1)[:3].zero_()
        alias = weight.data  # stays tied to the parameter
        values = alias.clone()
        with store.gathered([weight], modify=True):
            alias.add_(1.0)
        assert torch.equal(weight.detach().clone(), values + 1.0)
        # Metadata, conversions that change nothing, copies of a parameter.
        assert model.to("cpu") is model and weight.device.type == "cpu"
        copied = copy.deepcopy(weight)
        assert type(copied) is nn.Parameter and torch.equal(copied, values + 1.0)
        with pytest.raises(ParameterAccessError, match="OffloadConfig.precision"):
            model.half()
    assert type(weight) is nn.Parameter  # its own class again after close
    assert torch.equal(weight.detach(), values + 1.0)


def test_reads_outside_forward_are_differentiable(tmp_path):
    """A penalty on the weights computed outside any module's forward (an L2 term in the loop)
    sends its gradient to the parameters as in plain torch."""

    def penalised(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        losses = []
        data = synthetic_batches(SMALL, 4, seed=1)
        for _ in range(3):
            tokens, targets = next(data)
            penalty = sum(p.square().sum() for p in model.blocks[0].parameters())
            loss = model(tokens, targets) + 1e-2 * penalty
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    plain = make_model()
    attached = copy.deepcopy(plain)
    plain_losses = penalised(plain, fused_adamw(plain.parameters()))
    with infinity.TieredStore(infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path))) as store:
        model, optimizer = store.attach(attached, fused_adamw(attached.parameters()))
        losses = penalised(model, optimizer)
        state = model.state_dict()
    assert losses == plain_losses
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-7)


def test_a_forward_may_read_a_parameter_of_a_module_it_does_not_call(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)
            self.out = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(x @ self.inner.weight.t())  # inner's forward never runs
            return self.out(hidden)

    def run(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        torch.manual_seed(3)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    plain = Tied()
    attached = copy.deepcopy(plain)
    plain_losses = run(plain, fused_adamw(plain.parameters()))
    with infinity.TieredStore(infinity.OffloadConfig(**NVME, nvme_path=str(tmp_path))) as store:
        model, optimizer = store.attach(attached, fused_adamw(attached.parameters()))
        assert run(model, optimizer) == plain_losses


def test_bf16_edit_writes_back_only_the_elements_that_changed(tmp_path):
    model = make_model()
    config = infinity.OffloadConfig(
        **NVME, nvme_path=str(tmp_path), precision=infinity.PrecisionConfig(dtype="bf16")
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, fused_adamw(model.parameters()))
        train(model, optimizer, 1)
        masters = store.materialize(store.registry.entry_of(model.norm.weight))
        assert model.norm.weight.dtype == torch.bfloat16
        with store.gathered([model.norm.weight], modify=True), torch.no_grad():
            model.norm.weight[0] = 3.0
        after = model.state_dict()["norm.weight"]
    assert after.dtype == torch.float32 and after[0] == 3.0
    assert torch.equal(after[1:], masters[1:])  # fp32 bits kept, not rounded to bf16


class LoRALinear(nn.Module):
    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _lora_model(width: int = 128, rank: int = 4, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[LoRALinear(width, rank) for _ in range(layers)])


def _freeze_base(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if ".base." in name:
            param.requires_grad_(False)


def _lora_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1
) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 128, generator=generator)
        loss = (model(x) - x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_lora_frozen_base_weights_are_never_written_back(tmp_path):
    reference = _lora_model()
    attached = copy.deepcopy(reference)
    _freeze_base(reference)
    reference_optimizer = fused_adamw(reference.parameters())
    reference_losses = _lora_steps(reference, reference_optimizer, 2) + _lora_steps(
        reference, reference_optimizer, 4, seed=2
    )
    # 4 x 64 KiB of frozen base weights through a 128 KiB arena and a 160 KiB device tier:
    # they stream through both each step.
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        buffer_size=64 << 10,
        buffer_count=2,
        device_budget=160 << 10,
        nvme_path=str(tmp_path),
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(attached, fused_adamw(attached.parameters()))
        _freeze_base(model)  # frozen after attach
        losses = _lora_steps(model, optimizer, 2)
        written: list[str] = []
        store_async = store.placement.store_async

        def recording(shard, *args, **kwargs):  # every write-back, by shard
            written.append(shard.id)
            return store_async(shard, *args, **kwargs)

        store.placement.store_async = recording
        before = store.stats()
        losses += _lora_steps(model, optimizer, 4, seed=2)
        after = store.stats()
        state = model.state_dict()
        shards = list(store.registry.shards.values())
    assert losses == reference_losses
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    frozen = [s for s in shards if ".base." in s.id]
    assert frozen and all(not s.companions and s.grad is None for s in frozen)
    assert after["bytes_read"] > before["bytes_read"]  # the base weights did stream
    assert written and not [w for w in written if ".base." in w], written
    # Bytes written per step: the adapters' masters, gradients and Adam moments at most.
    adapters = sum(align_up(s.nbytes) for s in shards if ".base." not in s.id)
    assert (after["bytes_written"] - before["bytes_written"]) / 4 <= 4 * adapters
