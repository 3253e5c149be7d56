"""``step_in_backward='auto'`` (the default): the first step runs with updates in
``optimizer.step()`` and is watched; updates move into backward from the second step only when
that step had one backward, used no ``p.grad`` and kept its hyper-parameters, and the config
allows it. Every loop must train as plain PyTorch does (losses within 1e-5, parameters allclose
rtol 1e-5, atol 1e-6), whichever mode it ends up in; a loop that changes after the switch gets
a warning and updates back in ``optimizer.step()``, or, for a second backward, an error before
that gradient is used.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import infinity
from infinity.cli.common.tiny_gpt import synthetic_batches
from infinity.errors import BudgetError, ConfigError
from infinity.training.update_timing import UpdateMode
from tests.store_helpers import SMALL, assert_equivalent, fused_adamw, make_model

#: masters and Adam state swapped every step (a quarter of SMALL's training state in the arena)
TIGHT = {
    "offload_param": "nvme",
    "offload_optimizer": "nvme",
    "buffer_size": 1 << 14,
    "buffer_count": 16,
}


def run_loop(
    model,
    optimizer,
    steps,
    *,
    clip_at=(),
    accumulate_at=(),
    lr_after_backward=None,
    probe_at=(),
    clear_every=1,
    modes=None,
):
    """A nanoGPT-style loop; ``clip_at``: steps that clip by the global norm after backward;
    ``accumulate_at``: steps with two micro-batches; ``lr_after_backward(step)``: the rate set
    between backward and optimizer.step(); ``probe_at``: steps with an evaluation forward
    between backward and step (its loss goes into the norms' list); ``clear_every``: zero_grad
    after every that many steps. ``modes`` collects ``store.update_timing.mode`` after each
    backward."""
    data = synthetic_batches(SMALL, 4, seed=1)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        micro = 2 if step in accumulate_at else 1
        for _ in range(micro):
            tokens, targets = next(data)
            loss = model(tokens, targets) / micro
            loss.backward()
            total += loss.item()
        if modes is not None:
            modes.append(modes_of(optimizer))
        if step in clip_at:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        if step in probe_at:
            with torch.no_grad():
                norms.append(float(model(tokens, targets)))
        if lr_after_backward is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_after_backward(step)
        optimizer.step()
        if step % clear_every == clear_every - 1:
            optimizer.zero_grad()
        losses.append(total)
    return losses, norms


def modes_of(optimizer):
    store = getattr(optimizer, "store", None)
    return store.update_timing.mode if store is not None else None


def plain_and_attached(tmp_path, config=None, loop=None):
    """Both runs of ``loop`` (kwargs of run_loop) from the same model: (plain losses and norms,
    attached losses and norms, plain state, attached state, modes, store stats)."""
    loop = loop or {}
    reference = make_model()
    plain = copy.deepcopy(reference)
    plain_losses, plain_norms = run_loop(plain, fused_adamw(plain.parameters()), **loop)
    attached = copy.deepcopy(reference)
    store = infinity.TieredStore(
        infinity.OffloadConfig(nvme_path=str(tmp_path), **(config or TIGHT))
    )
    try:
        model, optimizer = store.attach(attached, fused_adamw(attached.parameters()))
        modes: list = []
        losses, norms = run_loop(model, optimizer, modes=modes, **loop)
        modes.append(store.update_timing.mode)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        stats = store.stats()
    finally:
        store.close()
    return (plain_losses, plain_norms), (losses, norms), plain.state_dict(), state, modes, stats


def attached(tmp_path, config=None):
    """A store under ``config`` (TIGHT) with the small GPT and its AdamW attached, and the
    loop's batches: (store, model, optimizer, batches)."""
    store = infinity.TieredStore(
        infinity.OffloadConfig(nvme_path=str(tmp_path), **(config or TIGHT))
    )
    model = make_model()
    model, optimizer = store.attach(model, fused_adamw(model.parameters()))
    return store, model, optimizer, synthetic_batches(SMALL, 4, seed=1)


def test_a_plain_loop_updates_in_backward_from_the_second_step(tmp_path):
    plain, ours, plain_state, state, modes, stats = plain_and_attached(tmp_path, loop={"steps": 6})
    assert modes[0] is UpdateMode.WATCHING
    assert all(m is UpdateMode.IN_BACKWARD for m in modes[1:])
    assert stats["update_mode"] == "in backward"
    assert_equivalent(plain[0], ours[0], plain_state, state)


def test_after_the_switch_no_gradient_goes_to_nvme(tmp_path):
    # The same arena writes gradients to NVMe when updates stay in optimizer.step() (so this
    # test can fail): from the second step on, each is consumed by its update in backward.
    def grad_transfers(config):
        store, model, optimizer, data = attached(tmp_path, config)
        try:
            kinds = []
            for _ in range(3):
                with store.timeline.recording():
                    model(*next(data)).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                kinds.append(sum(1 for t in store.timeline.transfers if t.shard.endswith("@grad")))
                store.timeline.transfers.clear()
            return kinds
        finally:
            store.close()

    assert min(grad_transfers({**TIGHT, "step_in_backward": False})) > 0
    first, *later = grad_transfers(TIGHT)
    assert first > 0 and later == [0, 0]


@pytest.mark.parametrize(
    "loop, reason",
    [
        ({"steps": 4, "clip_at": range(4)}, "used p.grad"),
        ({"steps": 4, "accumulate_at": range(4)}, "2 backward passes"),
        ({"steps": 4, "lr_after_backward": lambda step: 5e-4 * 0.5**step}, "['lr'] went from"),
        ({"steps": 4, "probe_at": range(4)}, "a forward pass"),
        # (gradients in host memory: a step with them on NVMe drops them, zero_grad or not)
        (
            {"steps": 4, "clear_every": 2, "config": {**TIGHT, "offload_optimizer": "cpu"}},
            "keeps gradients across optimizer.step()",
        ),
    ],
    ids=[
        "clipping",
        "accumulation",
        "lr_set_after_backward",
        "forward_before_step",
        "zero_grad_every_other_step",
    ],
)
def test_a_loop_that_needs_its_gradients_keeps_updates_in_step(tmp_path, caplog, loop, reason):
    loop = dict(loop)
    config = loop.pop("config", TIGHT)
    with caplog.at_level(logging.INFO, logger="infinity.training.update_timing"):
        plain, ours, plain_state, state, modes, _ = plain_and_attached(tmp_path, config, loop)
    assert modes[0] is UpdateMode.WATCHING
    assert all(m is UpdateMode.IN_STEP for m in modes[1:])
    assert reason in caplog.text
    assert_equivalent(plain[0], ours[0], plain_state, state)
    torch.testing.assert_close(torch.tensor(ours[1]), torch.tensor(plain[1]), rtol=1e-5, atol=1e-6)


def test_clipping_that_starts_later_warns_and_moves_updates_back(tmp_path, caplog):
    # The gradient of step 2 was applied in backward before the loop asked for it: that step
    # cannot be clipped, and the loop is told so; from step 3 on it clips as plain PyTorch.
    with caplog.at_level(logging.WARNING, logger="infinity.training.update_timing"):
        _, ours, _, _, modes, _ = plain_and_attached(
            tmp_path, loop={"steps": 5, "clip_at": (2, 3, 4)}
        )
    assert modes == [
        UpdateMode.WATCHING,
        UpdateMode.IN_BACKWARD,
        UpdateMode.IN_BACKWARD,
        UpdateMode.IN_STEP,
        UpdateMode.IN_STEP,
        UpdateMode.IN_STEP,
    ]
    assert "clipped nothing this step" in caplog.text
    assert "step_in_backward=False" in caplog.text
    assert ours[1][0] == 0.0  # no gradient left to measure at step 2
    assert ours[1][1] > 0 and ours[1][2] > 0


def test_an_lr_set_after_backward_later_warns_and_moves_updates_back(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.training.update_timing"):
        _, _, _, _, modes, _ = plain_and_attached(
            tmp_path, loop={"steps": 4, "lr_after_backward": lambda s: 1e-3 if s < 2 else 5e-4}
        )
    assert modes[2] is UpdateMode.IN_BACKWARD and modes[3:] == [UpdateMode.IN_STEP] * 2
    assert "['lr'] went from 0.001 to 0.0005" in caplog.text


def test_a_second_backward_after_the_switch_is_refused_before_its_gradient_is_used(tmp_path):
    store, model, optimizer, data = attached(tmp_path)
    try:
        for _ in range(2):
            model(*next(data)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert store.update_timing.in_backward
        model(*next(data)).backward()
        after_first = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(
            RuntimeError,
            match=r"step_in_backward='auto'.*"
            r"step_in_backward=False",
        ):
            model(*next(data)).backward()
        for key, value in model.state_dict().items():
            assert torch.equal(value, after_first[key]), f"the refused backward changed {key}"
        optimizer.step()
        optimizer.zero_grad()
        assert store.update_timing.mode is UpdateMode.IN_STEP
        for _ in range(2):  # accumulation works from here on
            for _ in range(2):
                model(*next(data)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert store.placement.audit() == []
    finally:
        store.close()


def test_a_forward_before_step_that_starts_later_warns_and_moves_updates_back(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.training.update_timing"):
        plain, ours, _, _, modes, _ = plain_and_attached(
            tmp_path, loop={"steps": 4, "probe_at": (2, 3)}
        )
    assert modes[2] is UpdateMode.IN_BACKWARD and modes[3:] == [UpdateMode.IN_STEP] * 2
    assert "a forward pass between backward and optimizer.step()" in caplog.text
    assert "saw the parameters after this step's update" in caplog.text
    assert ours[1][0] != plain[1][0]  # step 2's probe saw updated parameters, as it warned


def test_a_backward_that_raised_after_the_switch_leaves_a_store_that_trains_on(tmp_path, caplog):
    # Updates the failed pass ran in backward cannot be dropped with its gradients: the loop
    # is told, updates go back to optimizer.step(), and training goes on from there.
    store, model, optimizer, data = attached(tmp_path)
    try:
        fail = [False]

        def boom(grad):
            if fail[0]:
                raise ValueError("backward failed")

        handle = model.blocks[0].register_forward_hook(
            lambda module, args, out: out.register_hook(boom) and None
        )
        for step in range(5):
            fail[0] = step == 2
            loss = model(*next(data))
            with caplog.at_level(logging.WARNING, logger="infinity.training.update_timing"):
                try:
                    loss.backward()
                except ValueError:
                    optimizer.zero_grad()
                    continue
            optimizer.step()
            optimizer.zero_grad()
        handle.remove()
        assert "the gradients were cleared before optimizer.step()" in caplog.text
        assert store.update_timing.mode is UpdateMode.IN_STEP and store.steps == 4
        assert all(e.holds == 0 for e in store.registry.entries)
        assert store.placement.audit() == []
    finally:
        store.close()


def test_an_update_without_room_in_backward_waits_for_the_step(tmp_path, caplog):
    # An update in backward that finds no room next to what backward holds (forced here, the
    # third one of the second step) leaves it and the rest to optimizer.step(), which has the
    # whole arena: no error, the same results.
    reference = make_model()
    plain = copy.deepcopy(reference)
    plain_losses, _ = run_loop(plain, fused_adamw(plain.parameters()), 4)
    store = infinity.TieredStore(infinity.OffloadConfig(nvme_path=str(tmp_path), **TIGHT))
    try:
        attached = copy.deepcopy(reference)
        model, optimizer = store.attach(attached, fused_adamw(attached.parameters()))
        tiled_step, calls = store.stepping._tiled_step, []

        def no_room_once(optimizer, todo, multiplier, done):
            calls.append(todo[0].entry.name)
            if store.update_timing.in_backward and len(calls) == 3:
                raise BudgetError("no room in the host staging arena (forced by the test)")
            return tiled_step(optimizer, todo, multiplier, done)

        store.stepping._tiled_step = no_room_once
        modes: list = []
        with caplog.at_level(logging.INFO, logger="infinity.training.update_timing"):
            losses, _ = run_loop(model, optimizer, 4, modes=modes)
        assert "found no room (no room in the host staging arena (forced" in caplog.text
        assert modes == [UpdateMode.WATCHING] + [UpdateMode.IN_STEP] * 3
        state = {k: v.clone() for k, v in model.state_dict().items()}
        assert store.placement.audit() == []
    finally:
        store.close()
    assert_equivalent(plain_losses, losses, plain.state_dict(), state)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"gradient_clipping": 1.0}, "gradient_clipping=1 needs"),
        ({"precision": infinity.PrecisionConfig(dtype="fp16")}, "fp16 loss scaling"),
    ],
    ids=["clipping", "fp16"],
)
def test_a_config_that_needs_every_gradient_first_keeps_updates_in_step(
    tmp_path, caplog, changes, reason
):
    with caplog.at_level(logging.INFO, logger="infinity.training.update_timing"):
        store = infinity.TieredStore(
            infinity.OffloadConfig(nvme_path=str(tmp_path), **TIGHT, **changes)
        )
        try:
            model = make_model()
            store.attach(model, fused_adamw(model.parameters()))
            assert store.update_timing.mode is UpdateMode.IN_STEP
        finally:
            store.close()
    assert reason in caplog.text


def test_the_setting_accepts_true_false_and_auto_only():
    assert infinity.OffloadConfig().step_in_backward == "auto"
    assert infinity.OffloadConfig.from_dict({"step_in_backward": "AUTO"}).step_in_backward == "auto"
    assert infinity.OffloadConfig(step_in_backward=False).step_in_backward is False
    with pytest.raises(ConfigError, match=r"step_in_backward.*true, false or 'auto'"):
        infinity.OffloadConfig(step_in_backward="sometimes")
    with pytest.raises(ConfigError, match="gradient_clipping"):
        infinity.OffloadConfig(step_in_backward=True, gradient_clipping=1.0)
    # 'auto' with clipping is fine: it settles on updates in optimizer.step()
    assert infinity.OffloadConfig(gradient_clipping=1.0).step_in_backward == "auto"
