"""What training frameworks do to a model at set-up, on an attached one (one process; the ranks'
side is in tests/test_trainer_integrations.py):

* ``model.to("cpu:0")`` / ``torch.device("cpu", 0)`` (what accelerate hands each rank) is a no-op;
  ``.train()``, buffers converted, ``requires_grad_``, ``tie_weights()``,
  ``gradient_checkpointing_enable()`` work, and the run still follows the plain one;
* converting the parameters' dtype is refused naming ``OffloadConfig.precision``;
* ``clip_grad_norm_`` over the wrapped optimizer's ``param_groups`` (Lightning's and Fabric's way)
  returns the global norm and clips, as over ``model.parameters()``;
* ``infinity.store_of(model)`` finds the store; a copy of an attached model is plain (DDP may wrap
  it).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.errors import ParameterAccessError  # noqa: E402
from tests.test_transformers import NVME, adamw, batches, llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CLIP = 0.5


def _set_up_as_frameworks_do(model: torch.nn.Module) -> None:
    """The calls Trainer, accelerate and Lightning make on a model before training."""
    assert model.to("cpu:0") is model
    assert model.to(torch.device("cpu", 0)) is model
    assert model.to("cpu", torch.float32) is model  # the dtype it has: nothing to do
    model.eval()
    model.train()
    for module in model.modules():  # buffers follow a dtype the frameworks choose
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(torch.float64).to(torch.float32)
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.requires_grad_(False)
    weight.requires_grad_(True)
    model.tie_weights()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _train(model, optimizer, clip_params) -> tuple[list[float], list[float]]:
    model.train()
    losses, norms = [], []
    for input_ids in batches(4):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(clip_params(model, optimizer), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _model_params(model, optimizer):
    return model.parameters()


def _optimizer_params(model, optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_frameworks_set_up_calls_and_clipping_through_the_optimizer(tmp_path):
    reference = llama()
    plain = copy.deepcopy(reference)
    _set_up_as_frameworks_do(plain)
    plain_losses, plain_norms = _train(plain, adamw(plain), _model_params)
    assert max(plain_norms) > CLIP  # clipping is at work

    attached = copy.deepcopy(reference)
    # Small buffers: the larger parameters are several shards, each its own step parameter.
    config = infinity.OffloadConfig(
        nvme_path=str(tmp_path), **{**NVME, "buffer_size": 8 << 10, "buffer_count": 32}
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(attached, adamw(attached))
        assert infinity.store_of(model) is store and infinity.store_of(model.lm_head) is store
        _set_up_as_frameworks_do(model)
        assert len(_optimizer_params(model, optimizer)) > len(list(model.parameters()))
        losses, norms = _train(model, optimizer, _optimizer_params)

        with pytest.raises(ParameterAccessError, match=r"OffloadConfig\.precision"):
            model.to(torch.bfloat16)
        with pytest.raises(ParameterAccessError, match=r"OffloadConfig\.precision"):
            model.half()
        # Refused before anything changed: the model still computes in fp32.
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        copied = copy.deepcopy(model)  # a plain model, which DDP may wrap
        assert list(copied._ddp_params_and_buffers_to_ignore) == []
        state = model.state_dict()
    assert infinity.store_of(model) is None
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")

    for step, (a, b) in enumerate(zip(plain_norms, norms)):
        assert b == pytest.approx(a, rel=1e-5), f"step {step + 1}: norm {b} vs {a}"
    for step, (a, b) in enumerate(zip(plain_losses, losses)):
        assert abs(a - b) <= 1e-5, f"step {step + 1}: loss {b} vs {a}"
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
