"""``step_in_backward``: the optimizer update of each parameter runs inside backward, as soon
as its gradient is complete; ``optimizer.step()`` only finishes the step.

The results must match plain training exactly as the default mode does (losses within 1e-5,
parameters allclose rtol 1e-5, atol 1e-6); gradients must never be written to NVMe; a loop
that does not fit the mode (a second backward before the step) is refused before any of its
gradients is used; a failed update leaves a consistent store that the next step finishes.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.nn import functional as F

import infinity
from infinity.core.shards import ShardKind
from infinity.errors import ConfigError
from swap import SwapIOError
from tests.store_helpers import SMALL, assert_equivalent, compare, make_model
from tests.test_store_faults import Rig, batch
from tests.test_store_hooks import (
    GPT,
    CheckpointedGPT,
    SharedWeights,
    Twice,
    adamw,
    gpt_batches,
    gpt_loop,
    run_pair,
    seeded,
    vector_loop,
    vectors,
)

#: a staging arena of a quarter of SMALL's training state: masters and Adam state are swapped
#: every step, and updates must wait for reads
TIGHT = {
    "offload_param": "nvme",
    "offload_optimizer": "nvme",
    "buffer_size": 1 << 14,
    "buffer_count": 16,
    "step_in_backward": True,
}


@pytest.mark.parametrize(
    "config",
    [
        TIGHT,
        {
            "offload_param": "nvme",
            "offload_optimizer": "cpu",
            "buffer_size": 1 << 16,
            "step_in_backward": True,
        },
        {"offload_param": "cpu", "step_in_backward": True},
    ],
    ids=["state_on_nvme", "state_in_memory", "params_on_cpu"],
)
def test_training_matches_plain(tmp_path, config):
    result = compare(make_model(), 12, dict(config), tmp_path=tmp_path)
    assert_equivalent(*result[:4])
    assert result[4]["steps"] == 12


def test_lr_scheduler_sets_the_rate_the_next_backward_uses(tmp_path):
    def scheduler(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    result = compare(make_model(), 8, dict(TIGHT), tmp_path=tmp_path, scheduler_factory=scheduler)
    assert_equivalent(*result[:4])


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_activation_checkpointing(stores, tmp_path, reentrant):
    # Reentrant checkpointing runs nested backward passes, where a gradient may be partial:
    # their entries are updated by optimizer.step() instead.
    mode = {
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "buffer_size": 1 << 16,
        "buffer_count": 2,
        "device_budget": 1 << 16,
        "step_in_backward": True,
    }
    reference = seeded(lambda: CheckpointedGPT(GPT, reentrant))
    store, _, _ = run_pair(stores, tmp_path, reference, gpt_loop(gpt_batches(5)), mode)
    assert all(e.holds == 0 for e in store.registry.entries)


@pytest.mark.parametrize("factory", [SharedWeights, Twice], ids=["shared", "called_twice"])
def test_shared_parameters_and_modules_called_twice(stores, tmp_path, factory):
    # A parameter used by two modules, or a module run twice, is updated once, after its
    # gradient has every contribution.
    mode = {
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "buffer_size": 1 << 12,
        "buffer_count": 4,
        "device_budget": 1 << 12,
        "step_in_backward": True,
    }
    run_pair(
        stores, tmp_path, seeded(factory), vector_loop(vectors(6)), mode, optimizer_factory=adamw
    )


def attached(tmp_path, config: dict, model: torch.nn.Module):
    store = infinity.TieredStore(infinity.OffloadConfig(nvme_path=str(tmp_path), **config))
    wrapped, optimizer = store.attach(model, adamw(model))
    return store, wrapped, optimizer


def plain_and_attached(tmp_path):
    """A plain GPT with its AdamW, and an attached copy under TIGHT: (plain, its optimizer,
    store, model, optimizer)."""
    reference = make_model()
    plain = copy.deepcopy(reference)
    return (plain, adamw(plain), *attached(tmp_path, TIGHT, copy.deepcopy(reference)))


def test_backward_applies_the_update_and_step_finishes_it(tmp_path):
    plain, plain_opt, store, model, optimizer = plain_and_attached(tmp_path)
    try:
        batches = gpt_batches(3, SMALL)
        for step, (tokens, targets) in enumerate(batches):
            plain(tokens, targets).backward()
            plain_opt.step()
            plain_opt.zero_grad()
            before_step = store.steps
            model(tokens, targets).backward()
            # Every parameter already holds its updated value, before optimizer.step().
            after_backward = {k: v.clone() for k, v in model.state_dict().items()}
            for key, value in plain.state_dict().items():
                torch.testing.assert_close(
                    after_backward[key],
                    value,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, step=step, key=key: f"step {step}, {key}: {m}",
                )
            optimizer.step()
            optimizer.zero_grad()
            assert store.steps == before_step + 1
            for key, value in model.state_dict().items():
                assert torch.equal(value, after_backward[key]), f"step() changed {key}"
        assert store.placement.audit() == []
    finally:
        store.close()


def transferred_kinds(tmp_path, step_in_backward: bool) -> set[str]:
    """The kinds of shard (param, grad, optim:...) that the swap files saw in two steps after
    the first, under TIGHT's arena."""
    tmp_path.mkdir()
    store, model, optimizer = attached(
        tmp_path, {**TIGHT, "step_in_backward": step_in_backward}, make_model()
    )
    try:
        batches = gpt_batches(3, SMALL)
        tokens, targets = batches[0]
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        with store.timeline.recording():
            for tokens, targets in batches[1:]:
                model(tokens, targets).backward()
                optimizer.step()
                optimizer.zero_grad()
        return {
            t.shard.split("@")[1] if "@" in t.shard else "param" for t in store.timeline.transfers
        }
    finally:
        store.close()


def test_gradients_never_go_to_nvme(tmp_path):
    # The same arena swaps gradients without the mode (so this test can fail); with it, each
    # gradient is consumed by its update before anything needs its room.
    assert "grad" in transferred_kinds(tmp_path / "default", step_in_backward=False)
    kinds = transferred_kinds(tmp_path / "in_backward", step_in_backward=True)
    assert "grad" not in kinds
    assert {"param", "optim:exp_avg", "optim:exp_avg_sq"} <= kinds


def test_host_gradients_are_used_in_place_and_parked_when_the_update_waits(tmp_path):
    # Without a GPU a gradient is already a host tensor: the update in backward reads it where
    # autograd left it. Where the update has to wait for optimizer.step() (entries of nested
    # backward passes under reentrant checkpointing), the gradient moves into its companion
    # shard, inside the host budget, instead of staying outside it.
    config = {
        "offload_param": "nvme",
        "offload_optimizer": "nvme",
        "buffer_size": 1 << 16,
        "buffer_count": 4,
        "step_in_backward": True,
    }
    store, model, optimizer = attached(tmp_path, config, seeded(lambda: CheckpointedGPT(GPT, True)))
    plain = seeded(lambda: CheckpointedGPT(GPT, True))
    plain_opt = adamw(plain)
    try:
        for tokens, targets in gpt_batches(3):
            plain(tokens, targets).backward()
            plain_opt.step()
            plain_opt.zero_grad()
            model(tokens, targets).backward()
            placement = store.placement
            waiting = [
                s
                for s in placement.registry.shards.values()
                if s.kind is ShardKind.PARAM and placement.gradients.has_grad(s)
            ]
            updated = [
                e for e in store.registry.entries if e.index in store.stepping.updated_in_backward
            ]
            assert waiting and updated  # both paths ran: some updates waited, some did not
            assert all(s.grad is None and placement.gradients.grad_in_companion(s) for s in waiting)
            assert placement.gradients.grad_bytes == 0
            assert placement.audit() == []
            optimizer.step()
            optimizer.zero_grad()
        assert store.stats()["bytes_from_device"] == 0
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    finally:
        store.close()


def test_no_gradient_is_copied_off_a_cpu_device(tmp_path):
    store, model, optimizer = attached(tmp_path, TIGHT, make_model())
    try:
        for tokens, targets in gpt_batches(3, SMALL):
            model(tokens, targets).backward()
            assert (
                store.placement.gradients.grad_bytes == 0
            )  # each consumed by its update, then freed
            optimizer.step()
            optimizer.zero_grad()
        assert store.stats()["bytes_from_device"] == 0
        assert store.stats()["bytes_to_device"] > 0
    finally:
        store.close()


def test_a_second_backward_before_step_is_refused_before_its_gradients_are_used(tmp_path):
    plain, plain_opt, store, model, optimizer = plain_and_attached(tmp_path)
    try:
        batches = gpt_batches(4, SMALL)
        tokens, targets = batches[0]
        model(tokens, targets).backward()
        after_first = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"step_in_backward=True.*optimizer\.step\(\)"):
            model(*batches[1]).backward()  # gradient accumulation: not in this mode
        for key, value in model.state_dict().items():
            assert torch.equal(value, after_first[key]), f"the refused backward changed {key}"
        assert store.placement.audit() == []
        # The loop can go on: the step finishes the first backward's update.
        optimizer.step()
        optimizer.zero_grad()
        plain(*batches[0]).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        for tokens, targets in batches[2:]:
            for net, opt in ((model, optimizer), (plain, plain_opt)):
                net(tokens, targets).backward()
                opt.step()
                opt.zero_grad()
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    finally:
        store.close()


def test_an_update_that_fails_in_backward_is_finished_by_step(tmp_path):
    """A persistent read fault stops backward inside an update. The layers whose update ran
    hold their new values, the layers backward never reached keep their old ones (they got no
    gradient), the store stays consistent, and once the fault is gone optimizer.step() updates
    what the failed update left, none twice; training then goes on."""
    rig = Rig(tmp_path, step_in_backward=True)
    try:
        rig.step()
        rig.plain_step()
        before = rig.plain_values()
        x = batch(rig.step_count)
        rig.step_count += 1
        loss = rig.model(x)
        # Backward's first read is the optimizer state of the first update (the last layer).
        rig.faults.inject("eio", "read", times=None)
        with pytest.raises(SwapIOError) as caught:
            loss.backward()
        note = " ".join(getattr(caught.value, "__notes__", []))
        assert re.search(r"the update of \S+ in backward stopped", note), note
        rig.check()
        rig.faults.clear()
        rig.opt.step()
        rig.opt.zero_grad()
        rig.plain_step()
        after = rig.plain_values()
        values = rig.values()
        updated = [
            name
            for name in values
            if torch.allclose(values[name], after[name], rtol=1e-5, atol=1e-6)
        ]
        kept = [name for name in values if torch.equal(values[name], before[name])]
        assert sorted(updated + kept) == sorted(values), "a value is neither old nor new"
        # Backward runs from the last layer: the updated ones are the last layers.
        order = [name for name in values]
        assert (
            updated and kept and all(order.index(k) < order.index(u) for k in kept for u in updated)
        ), (updated, kept)
        rig.check()
        loss = rig.step()
        assert torch.isfinite(torch.tensor(loss))
        rig.check()
    finally:
        rig.close()


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"gradient_clipping": 1.0}, "gradient_clipping"),
        ({"precision": infinity.PrecisionConfig(dtype="fp16")}, "fp16"),
    ],
)
def test_config_refuses_what_needs_every_gradient_first(changes, needle):
    with pytest.raises(ConfigError, match=needle) as caught:
        infinity.OffloadConfig(step_in_backward=True, **changes)
    assert caught.value.field == "step_in_backward"
    infinity.OffloadConfig(step_in_backward=False, **changes)  # fine without the mode


def test_sgd_with_momentum_and_no_swap_files():
    # Another optimizer's state, updated in backward with every master in memory.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    store = infinity.TieredStore(infinity.OffloadConfig(offload_param="cpu", step_in_backward=True))
    try:
        model, optimizer = store.attach(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        for x, y in vectors(4, batch=4):
            x = x[:, :8]
            for net, opt in ((model, optimizer), (plain, plain_opt)):
                F.cross_entropy(net(x), y % 2).backward()
                opt.step()
                opt.zero_grad()
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    finally:
        store.close()
