"""The real-client tier: programs written as users write them, not as the store's internals are
convenient to test. Each seeds once at the top, builds, attaches, then draws its data and dropout
from the global random streams, and is held against the same program without the store.

- the store never touches the user's random streams: attach in a fresh process (where the
  runtime's one-time set-up happens), and every public call through a guard;
- nanoGPT's loop (dropout, accumulation, clipping, evaluation, resume from its own state dicts)
  under a host budget whose arena is smaller than the state, so every step swaps;
- inference and training under small host budgets with an embedding larger than an arena slot;
- Hugging Face Trainer and Lightning, with dropout, under a host budget.
The README's and the docs' code blocks run as written in tests/test_readme_snippets.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import BudgetError
from infinity.planning.profiles import DiskProfile
from tests import real_client_programs as programs
from tests.real_client_programs import rng_state

ROOT = Path(__file__).resolve().parents[1]
SNIPPET_CONFIGS = [
    {"offload_param": "nvme", "offload_optimizer": "nvme", "host_budget": "256MiB"},
    {"offload_param": "cpu", "offload_optimizer": "cpu", "host_budget": "256MiB"},
    {"offload_param": "nvme", "offload_optimizer": "nvme"},
]


def _in_fresh_process(function: str, argument: Any) -> Any:
    """``tests.real_client_programs.<function>(argument)`` in a process of its own: what the
    store sets up once per process (the runtime's warm-up under a host budget) happens there,
    as in a user's script."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1])\n"
        "from tests import real_client_programs as programs\n"
        f"print(json.dumps(programs.{function}(json.loads(sys.argv[2]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), json.dumps(argument)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", SNIPPET_CONFIGS, ids=["nvme-budget", "cpu-budget", "nvme"])
def test_attach_in_a_fresh_process_leaves_the_global_streams_where_they_were(config):
    """The issue's snippet, each config in a process of its own: attach draws nothing from
    torch's, Python's or numpy's global streams."""
    assert _in_fresh_process("attach_snippet", config) == programs.attach_snippet(None)


class RngGuard:
    """Stands for an object (the store, the wrapped optimizer) and fails any public call that
    leaves a global random stream other than it found it."""

    def __init__(self, target: Any, name: str) -> None:
        self._target = target
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        value = getattr(self._target, attribute)
        if attribute.startswith("_") or not callable(value):
            return value

        return lambda *args, **kwargs: _guarded_call(
            f"{self._name}.{attribute}()", lambda: value(*args, **kwargs)
        )


def _guarded_call(what: str, call: Callable[[], Any]) -> Any:
    before = rng_state()
    result = call()
    assert rng_state() == before, f"{what} changed a global random stream"
    return result


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"host_budget": "36MiB", "step_in_backward": True},
        {"offload_param": "cpu", "offload_optimizer": "cpu", "host_budget": "64MiB"},
        {"precision": infinity.PrecisionConfig(optimizer_state_dtype="int8")},
        {
            "precision": infinity.PrecisionConfig(
                dtype="bf16", master_dtype="bf16", optimizer_state_dtype="int8"
            )
        },
    ],
    ids=["nvme-budget", "in-backward", "cpu", "int8-state", "bf16-masters"],
)
def test_no_public_call_changes_the_global_streams(tmp_path, changes):
    """Every public call a training program makes, through a guard: the store's, the wrapped
    optimizer's, the attached model's forward and backward (a model that draws nothing itself),
    state dicts, gathered, predict, checkpoints (a load puts back the streams the save found,
    which the program had not moved since) and close."""
    torch.manual_seed(0)
    model = programs.GPT(**{**programs.SIZES, "dropout": 0.0})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = programs.store_config(tmp_path, **changes)
    store = RngGuard(_guarded_call("TieredStore()", lambda: infinity.TieredStore(config)), "store")
    model, wrapped = store.attach(model, optimizer)
    optimizer = RngGuard(wrapped, "optimizer")
    tokens = torch.arange(4 * 32).reshape(4, 32) % programs.SIZES["vocab"]
    for _ in range(3):
        loss = _guarded_call("forward", lambda: model(tokens, tokens))
        _guarded_call("backward", loss.backward)
        _guarded_call("clip_grad_norm_", lambda: nn.utils.clip_grad_norm_(model.parameters(), 1))
        optimizer.step()
        optimizer.zero_grad()
    store.stats()
    store.predict(disk=DiskProfile(2.0, 1.5), device="H100", host_budget="48MiB")
    _guarded_call("model.state_dict()", model.state_dict)
    state = _guarded_call("optimizer.state_dict()", optimizer.state_dict)
    optimizer.load_state_dict(state)
    with store.gathered(list(model.parameters())[:2]):
        pass
    store.save_checkpoint(tmp_path / "checkpoint")
    store.load_checkpoint(tmp_path / "checkpoint")
    with torch.no_grad():
        _guarded_call("inference forward", lambda: model.eval()(tokens, tokens))
    store.close()


@pytest.mark.slow
def test_nanogpt_loop_follows_its_plain_run_and_resumes(tmp_path):
    """nanoGPT's train.py with the two attach lines, in a fresh process as a user runs it:
    every logged loss and evaluation within 2e-4 of the plain run, through a resume from the
    state dicts it saved, and the store really swapped (its arena is smaller than the state)."""
    attached = _in_fresh_process("nanogpt_with_resume", str(tmp_path))
    plain = programs.nanogpt_with_resume(None)
    assert attached["bytes_read"] > 0
    for key in ("loss", "eval", "resumed_loss", "resumed_eval"):
        assert len(attached[key]) == len(plain[key]) > 0
        for step, (x, y) in enumerate(zip(plain[key], attached[key])):
            assert abs(x - y) <= 2e-4, f"{key} at {step}: {y} against {x}"


def _llama(vocab: int, hidden: int, layers: int, dropout: float = 0.0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_dropout=dropout,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "hidden, layers, host_budget, device_budget, least_arena",
    [(256, 2, "24MiB", "40MiB", 0), (1024, 1, "256MiB", "128MiB", 200 << 20)],
    ids=["arena-smaller-than-the-embedding", "the-issue-s-shape"],
)
def test_inference_under_a_small_host_budget_streams_an_embedding_larger_than_a_slot(
    tmp_path, hidden, layers, host_budget, device_budget, least_arena
):
    """A Llama whose embedding (32000 x hidden) is larger than an arena slot (in the first case
    larger than the whole arena), attached without an optimizer under a small host budget: the
    first forward streams it from NVMe and gives the in-RAM logits. Without an optimizer there
    is no gradient or optimizer reserve (the issue's shape had 20 MiB of arena in 256 MiB), and
    a forward's reads ahead give way to the shard needed now."""
    torch.manual_seed(0)
    model = _llama(32000, hidden, layers).eval()
    ids = torch.randint(0, 32000, (1, 16))
    with torch.no_grad():
        expected = model(ids).logits
    config = infinity.OffloadConfig(
        offload_param="nvme",
        nvme_path=str(tmp_path),
        host_budget=host_budget,
        device_budget=device_budget,
        device="cpu",
    )
    embedding = 32000 * hidden * 4
    with infinity.TieredStore(config) as store:
        model, _ = store.attach(model)
        budgets = store.stats()["budgets"]
        assert budgets["arena"] >= least_arena, budgets
        # no optimizer: only the decode of one shard and a margin, not training's reserve
        assert budgets["transient_reserved"] <= budgets["slot"] + (32 << 20), budgets
        with torch.no_grad():
            logits = model(ids).logits
        assert store.stats()["bytes_read"] >= embedding
    assert torch.equal(logits, expected)


def test_training_under_a_small_host_budget_with_an_embedding_larger_than_a_slot(tmp_path):
    """Training a Llama whose embedding (4096 x 128: 2 MiB, eight 256 KiB slots) under a host
    budget smaller than its state follows the plain run's losses."""

    def run(nvme: Path | None) -> list[float]:
        torch.manual_seed(0)
        model = _llama(4096, 128, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        store = None
        if nvme is not None:
            store = infinity.TieredStore(
                infinity.OffloadConfig(
                    offload_param="nvme",
                    offload_optimizer="nvme",
                    nvme_path=str(nvme),
                    host_budget="40MiB",
                    buffer_size="256KiB",
                    device="cpu",
                )
            )
            model, optimizer = store.attach(model, optimizer)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 4096, (2, 16))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if store is not None:
            assert store.stats()["bytes_read"] > 0
            store.close()
        return losses

    plain = run(None)
    attached = run(tmp_path)
    assert attached == pytest.approx(plain, rel=1e-5)


def test_a_budget_without_room_for_one_buffer_is_refused_at_attach(tmp_path):
    """Where the budget cannot hold what one gather needs (a buffer of the arena), attach says so
    with both numbers and the setting to change; the first forward never meets it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8))
    config = infinity.OffloadConfig(
        offload_param="nvme",
        nvme_path=str(tmp_path),
        host_budget="4MiB",
        buffer_size="8MiB",
        device="cpu",
    )
    with infinity.TieredStore(config) as store:
        with pytest.raises(BudgetError, match=r"host_budget of \d+ bytes.*raise host_budget"):
            store.attach(model)


def test_the_readme_s_small_mlp_updates_in_backward_under_its_budget(tmp_path, caplog):
    """The README's first snippet on a 66K-parameter MLP under 64 MiB: the arena caches every
    byte, so nothing keeps the updates out of backward (the log once asked for 257 MiB)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    config = infinity.OffloadConfig(
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=str(tmp_path),
        host_budget="64MiB",
        device="cpu",
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, optimizer)
        for _ in range(3):
            model(torch.randn(8, 256)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        stats = store.stats()
    assert stats["update_mode"] == "in backward", stats["update_mode_reasons"]


@pytest.mark.slow
def test_hf_trainer_with_dropout_under_a_host_budget_follows_the_plain_trainer(tmp_path):
    """A Trainer script as written: the model built after a seed (dropout on), attached under a
    host budget, InfinityTrainer; every logged loss and gradient norm within 1e-5 of the plain
    Trainer's."""
    pytest.importorskip("accelerate")
    from tests import trainer_runs as runs

    budget = {"host_budget": "36MiB"}
    plain = runs.hf_run("plain", tmp_path / "plain", dropout=0.1)
    attached = runs.hf_run(
        "infinity", tmp_path / "attached", tmp_path / "nvme", dropout=0.1, store_changes=budget
    )
    for key in ("loss", "grad_norm", "eval_loss"):
        assert attached[key] == pytest.approx(plain[key], rel=1e-5), key


@pytest.mark.slow
@pytest.mark.usefixtures("launch_environment_restored")
def test_lightning_with_dropout_under_a_host_budget_follows_plain_lightning(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from tests import trainer_runs as runs

    plain = runs.lightning_run("plain", tmp_path / "plain", None, 1, 6, dropout=0.1)
    attached = runs.lightning_run(
        "infinity",
        tmp_path / "attached",
        tmp_path / "nvme",
        1,
        6,
        dropout=0.1,
        store_changes={"host_budget": "36MiB"},
    )
    assert len(attached["rows"]) == len(plain["rows"]) == 6
    for a, b in zip(plain["rows"], attached["rows"]):
        assert b == pytest.approx(a, rel=1e-5)
