"""Hugging Face Trainer, accelerate and Lightning on an attached model (infinity.integrations),
each against the same framework without the store: on 2 gloo ranks (where the framework alone
runs DistributedDataParallel) and in one process.

Each run trains a tiny Llama with gradient accumulation 2 and clipping at 0.5 (the gradients
exceed it). With the store, every logged loss and gradient norm must be within 1e-5 (relative)
of the run without it, every rank must end with the same parameters as the other ranks and as
that run, and checkpoints must resume: Trainer saved at step 4 and resumed to step 8 equals the
uninterrupted run bit for bit on the same ranks, and the 2-rank checkpoint resumes in one process
within 1e-5; accelerate's save_state/load_state and Lightning's ckpt_path likewise. A peft LoRA
model trained on 2 ranks never writes its frozen base weights to NVMe after attach.

The ranks' runs share one spawn (the ``ranks`` fixture); the tests read its results.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import infinity
from infinity.errors import AttachError, ConfigError
from tests import trainer_runs as runs
from tests.dist_helpers import run_ranks


def _available(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


PEFT = _available("peft")
LIGHTNING = _available("pytorch_lightning")
TRL = _available("trl")
WORLD = 2
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def _on_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Everything the tests check across ranks, run on each rank of one spawn."""
    runs.set_rank_environment(rank, world)
    root_path = Path(root)
    nvme = root_path / "nvme"
    results: dict[str, Any] = {"set_up": _set_up_calls_and_ddp(nvme)}
    results["hf_plain"] = runs.hf_run("plain", root_path / "hf-plain")
    results["hf"] = runs.hf_run("infinity", root_path / "hf", nvme, export=True)
    results["hf_resumed"] = runs.hf_run(
        "infinity", root_path / "hf-resumed", nvme, resume=root_path / "hf" / "checkpoint-4"
    )
    results["s2s_plain"] = runs.seq2seq_run("plain", root_path / "s2s-plain")
    results["s2s"] = runs.seq2seq_run("infinity", root_path / "s2s", nvme)
    results["acc_plain"] = runs.accelerate_run("plain", root_path / "acc-plain")
    results["acc"] = runs.accelerate_run("infinity", root_path / "acc", nvme)
    if PEFT:
        results["lora"] = runs.hf_lora_run(root_path / "lora", nvme)
    if LIGHTNING:
        results["lit_plain"] = runs.lightning_run("plain", root_path / "lit-plain", None, world, 6)
        results["lit"] = runs.lightning_run("infinity", root_path / "lit", nvme, world, 6)
        results["lit_resumed"] = runs.lightning_run(
            "infinity",
            root_path / "lit-resumed",
            nvme,
            world,
            6,
            resume=root_path / "lit" / "epoch=0-step=4.ckpt",
        )
    return results


def _set_up_calls_and_ddp(nvme: Path) -> dict[str, Any]:
    """On each rank: the calls frameworks make on a model at set-up, then a step with clipping;
    and wrapping the attached model in DistributedDataParallel, which must raise (before the
    guard, it crashed the process)."""
    import accelerate
    import transformers

    from tests.test_framework_setup_calls import _set_up_as_frameworks_do

    model = runs.llama()
    with infinity.TieredStore(runs.store_config(nvme)) as store:
        model, optimizer = store.attach(model, runs.fused_adamw(model.parameters()))
        _set_up_as_frameworks_do(model)
        tokens = runs.sequences(4, seed=10 + torch.distributed.get_rank())
        model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), runs.CLIP))
        optimizer.step()
        optimizer.zero_grad()
        refused = _refusal(lambda: torch.nn.parallel.DistributedDataParallel(model))
        # What a user meets who hands the attached model to a framework's own DDP wrapping:
        # the error names the integration that runs it.
        by_accelerate = _refusal(lambda: accelerate.Accelerator(cpu=True).prepare(model))
        trainer = transformers.Trainer(
            model=model,
            args=runs.trainer_arguments(
                nvme.parent / "plain-trainer", 1, 2, eval_strategy="no", save_strategy="no"
            ),
            train_dataset=runs.Sequences(8),
            optimizers=(optimizer, None),
        )
        by_trainer = _refusal(trainer.train)
        return {
            "refused": refused,
            "by_accelerate": by_accelerate,
            "by_trainer": by_trainer,
            "norm": norm,
            "params": runs.parameters(model),
        }


def _refusal(call: Any) -> str:
    """The AttachError ``call()`` raises, as text."""
    try:
        call()
    except AttachError as exc:
        return str(exc)
    return "not refused"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ranks")
    results = run_ranks(_on_rank, WORLD, str(root), timeout=900, collective_timeout=300)
    results[-1] = {"root": root}  # where the ranks left their checkpoints
    return results


def _close(a: list[float], b: list[float], what: str, rel: float = 1e-5) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} values"
    for step, (x, y) in enumerate(zip(a, b)):
        assert y == pytest.approx(x, rel=rel, abs=1e-7), f"{what} at step {step + 1}: {y} vs {x}"


def _same_params(a: dict, b: dict, what: str, exact: bool = False) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if exact:
            assert np.array_equal(x, y), f"{what}: {name} differs"
        else:
            # Against the run without the store: the same arithmetic but for the order of the
            # gradient reduction, whose last-bit differences Adam (lr 1e-2) amplifies where a
            # gradient is near zero; 1e-5 is a thousandth of one step's update.
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5, err_msg=f"{what}: {name}")


def _ranks_agree(results: dict, key: str) -> None:
    """Every rank ended with the same parameters."""
    for rank in range(1, WORLD):
        _same_params(results[0][key]["params"], results[rank][key]["params"], key, exact=True)


# -- across ranks ------------------------------------------------------------------------------
def test_set_up_calls_work_on_every_rank_and_ddp_is_refused_clearly(ranks):
    for rank in range(WORLD):
        message = ranks[rank]["set_up"]["refused"]
        assert "InfinityTrainer" in message and "DistributedDataParallel" in message, message
        # A framework's own wrapping is named, with the one integration that replaces it.
        by_trainer = ranks[rank]["set_up"]["by_trainer"]
        assert "Hugging Face Trainer wraps it" in by_trainer, by_trainer
        assert "InfinityTrainer" in by_trainer and "InfinityAccelerator" not in by_trainer
        by_accelerate = ranks[rank]["set_up"]["by_accelerate"]
        assert "accelerate's prepare() wraps it" in by_accelerate, by_accelerate
        assert "InfinityAccelerator" in by_accelerate and "InfinityTrainer" not in by_accelerate
        # Each rank its own batch; one global norm, one update, the same parameters everywhere.
        assert ranks[rank]["set_up"]["norm"] == ranks[0]["set_up"]["norm"] > runs.CLIP
    _ranks_agree(ranks, "set_up")


def test_trainer_across_ranks_follows_ddp(ranks):
    for rank in range(WORLD):
        plain, attached = ranks[rank]["hf_plain"], ranks[rank]["hf"]
        assert plain["wrapped"] == "DistributedDataParallel"
        assert attached["wrapped"] == "LlamaForCausalLM"  # never wrapped
        assert attached["steps"] == list(range(1, 9))
        assert max(plain["grad_norm"]) > runs.CLIP  # clipping is at work
        _close(plain["loss"], attached["loss"], f"rank {rank} loss")
        _close(plain["grad_norm"], attached["grad_norm"], f"rank {rank} grad_norm")
        assert attached["lr"] == plain["lr"]
        _close(plain["eval_loss"], attached["eval_loss"], f"rank {rank} eval_loss")
        _same_params(plain["params"], attached["params"], f"rank {rank}")
    _ranks_agree(ranks, "hf")


def _seq2seq_follows(plain: dict, attached: dict, what: str) -> None:
    assert len(attached["loss"]) == 6 and len(attached["eval_loss"]) == 2
    _close(plain["loss"], attached["loss"], f"{what} loss")
    _close(plain["grad_norm"], attached["grad_norm"], f"{what} grad_norm")
    _close(plain["eval_loss"], attached["eval_loss"], f"{what} eval_loss")
    _same_params(plain["params"], attached["params"], what)
    # predict_with_generate: the same tokens generated (a few steps in, greedy)
    assert np.array_equal(np.asarray(plain["generated"]), np.asarray(attached["generated"])), what


def test_seq2seq_trainer_across_ranks_follows_ddp_and_generates_the_same(ranks):
    """Seq2SeqTrainer's generation across ranks runs with synced_gpus on the store (each
    forward is collective), so ranks that finish early keep stepping with the others."""
    for rank in range(WORLD):
        _seq2seq_follows(ranks[rank]["s2s_plain"], ranks[rank]["s2s"], f"rank {rank}")
    _ranks_agree(ranks, "s2s")


def test_trainer_checkpoints_are_the_stores_and_resume_bit_exactly(ranks):
    checkpoint = ranks[-1]["root"] / "hf" / "checkpoint-4"
    # The store's checkpoint (one data file per rank), Trainer's state and RNG files: no
    # pickled optimizer, no weights file gathered on one rank.
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "infinity",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
    ]
    assert {"data-0.bin", "data-1.bin", "infinity.json"} <= {
        p.name for p in (checkpoint / "infinity").iterdir()
    }
    for rank in range(WORLD):
        whole, resumed = ranks[rank]["hf"], ranks[rank]["hf_resumed"]
        assert resumed["steps"] == list(range(1, 9))  # steps 1-4 come from trainer_state.json
        for key in ("loss", "grad_norm", "lr"):
            assert resumed[key][4:] == whole[key][4:], (rank, key)
        _same_params(whole["params"], resumed["params"], f"rank {rank} resumed", exact=True)
    _check_export(ranks[-1]["root"] / "hf" / "export", ranks[0]["hf"]["params"])


def _check_export(path: Path, params: dict) -> None:
    """trainer.save_model() wrote safetensors (assembled from a store checkpoint, one file at a
    time) that from_pretrained loads with the trained values."""
    import transformers

    assert "model.safetensors" in {p.name for p in path.iterdir()}
    assert not (path / ".infinity-export").exists()  # the staging checkpoint is gone
    loaded = transformers.LlamaForCausalLM.from_pretrained(path)
    values = {name: p.detach() for name, p in loaded.named_parameters()}
    _same_params(params, values, "exported", exact=True)


def test_trainer_resumes_a_two_rank_checkpoint_in_one_process(ranks, tmp_path):
    # The same global batch: one process takes both ranks' micro-batches.
    resumed = runs.hf_run(
        "infinity",
        tmp_path / "out",
        tmp_path / "nvme",
        batch=2 * WORLD,
        resume=ranks[-1]["root"] / "hf" / "checkpoint-4",
    )
    whole = ranks[0]["hf"]
    _close(whole["loss"][4:], resumed["loss"][4:], "loss after resuming on 1 rank")
    _close(whole["grad_norm"][4:], resumed["grad_norm"][4:], "grad_norm after resuming on 1 rank")
    _same_params(whole["params"], resumed["params"], "resumed on 1 rank")


@pytest.mark.skipif(not PEFT, reason="peft is not installed")
def test_lora_across_ranks_never_writes_the_frozen_base(ranks):
    for rank in range(WORLD):
        lora = ranks[rank]["lora"]
        assert lora["writes"].get("frozen", 0) == 0, lora["writes"]
        assert lora["writes"].get("trainable", 0) > 0, lora["writes"]  # the arena is too small
        assert lora["changed"] == lora["trainable"] and lora["trainable"]
        assert all("lora_" in name for name in lora["trainable"])
        assert lora["loss"][-1] < lora["loss"][0]
        assert "adapter_model.safetensors" in lora["saved"]
        assert "model.safetensors" not in lora["saved"]


def test_accelerate_across_ranks_follows_ddp(ranks):
    for rank in range(WORLD):
        plain, attached = ranks[rank]["acc_plain"], ranks[rank]["acc"]
        assert plain["prepared"] == "DistributedDataParallel"
        assert attached["prepared"] == "LlamaForCausalLM"
        assert max(n for n, _ in plain["rows"]) > runs.CLIP
        for i, what in enumerate(("grad norm", "loss")):
            _close([r[i] for r in plain["rows"]], [r[i] for r in attached["rows"]], what)
        _same_params(plain["params"], attached["params"], f"rank {rank}")
        # load_state, then steps 3 and 4 again: the same as the first time, bit for bit.
        assert attached["rows"][4:] == attached["rows"][2:4]
        _same_params(attached["params"], attached["again"], "after load_state", exact=True)
        assert "infinity" in attached["saved"]
        assert not {"model.safetensors", "optimizer.bin"} & set(attached["saved"])
    _ranks_agree(ranks, "acc")


@pytest.mark.skipif(not LIGHTNING, reason="pytorch-lightning is not installed")
def test_lightning_across_ranks_follows_ddp_and_resumes(ranks):
    for rank in range(WORLD):
        plain, attached = ranks[rank]["lit_plain"], ranks[rank]["lit"]
        resumed = ranks[rank]["lit_resumed"]
        assert len(attached["rows"]) == 6 and max(r[0] for r in plain["rows"]) > runs.CLIP
        for i, what in enumerate(("grad norm", "lr", "loss")):
            _close([r[i] for r in plain["rows"]], [r[i] for r in attached["rows"]], what)
        assert attached["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-5)
        _same_params(plain["params"], attached["params"], f"rank {rank}")
        assert resumed["rows"] == attached["rows"][4:] and resumed["global_step"] == 6
        _same_params(attached["params"], resumed["params"], "resumed", exact=True)
        # validate() after fit on the module still attached, then close() gives it back.
        assert np.isfinite(attached["validated"])
        _same_params(attached["params"], attached["closed"], "closed", exact=True)
    _ranks_agree(ranks, "lit")
    checkpoint = ranks[-1]["root"] / "lit" / "epoch=0-step=4.ckpt"
    assert {"data-0.bin", "data-1.bin", "lightning.pt"} <= {p.name for p in checkpoint.iterdir()}


# -- one process -------------------------------------------------------------------------------
def test_trainer_in_one_process_follows_trainer(tmp_path):
    plain = runs.hf_run("plain", tmp_path / "plain")
    attached = runs.hf_run("infinity", tmp_path / "attached", tmp_path / "nvme", export=True)
    _check_export(tmp_path / "attached" / "export", attached["params"])
    _close(plain["loss"], attached["loss"], "loss")
    _close(plain["grad_norm"], attached["grad_norm"], "grad_norm")
    _close(plain["eval_loss"], attached["eval_loss"], "eval_loss")
    _same_params(plain["params"], attached["params"], "one process")


def test_seq2seq_trainer_in_one_process_follows_seq2seq_trainer(tmp_path):
    plain = runs.seq2seq_run("plain", tmp_path / "plain")
    attached = runs.seq2seq_run("infinity", tmp_path / "attached", tmp_path / "nvme")
    _seq2seq_follows(plain, attached, "one process")


@pytest.mark.skipif(not TRL, reason="trl is not installed")
def test_trl_sft_trainer_with_the_store_follows_sft_trainer(tmp_path):
    plain = runs.sft_run("plain", tmp_path / "plain")
    attached = runs.sft_run("infinity", tmp_path / "attached", tmp_path / "nvme")
    assert len(attached["loss"]) == 6
    assert max(plain["grad_norm"]) > runs.CLIP  # clipping is at work
    _close(plain["loss"], attached["loss"], "loss")
    _close(plain["grad_norm"], attached["grad_norm"], "grad_norm")
    _same_params(plain["params"], attached["params"], "one process")


@pytest.mark.skipif(not TRL, reason="trl is not installed")
def test_sft_config_s_default_bf16_is_refused_naming_the_class_and_the_fix(tmp_path):
    """SFTConfig turns bf16 on unless told otherwise: the refusal says how, on that class."""
    import trl

    from infinity.integrations.hf import with_store

    arguments = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert arguments.bf16
    with pytest.raises(ConfigError, match=r"SFTConfig\(bf16=True\).*pass bf16=False to SFTConfig"):
        with_store(trl.SFTTrainer)(
            model=runs.llama(),
            args=arguments,
            processing_class=runs.tokenizer(),
            offload_config=infinity.OffloadConfig(),
        )


def test_accelerate_in_one_process_follows_accelerate(tmp_path):
    plain = runs.accelerate_run("plain", tmp_path / "plain")
    attached = runs.accelerate_run("infinity", tmp_path / "attached", tmp_path / "nvme")
    for i, what in enumerate(("grad norm", "loss")):
        _close([r[i] for r in plain["rows"]], [r[i] for r in attached["rows"]], what)
    _same_params(plain["params"], attached["params"], "one process")
    assert attached["rows"][4:] == attached["rows"][2:4]


@pytest.mark.skipif(not LIGHTNING, reason="pytorch-lightning is not installed")
@pytest.mark.usefixtures("launch_environment_restored")
def test_lightning_in_one_process_follows_lightning(tmp_path):
    plain = runs.lightning_run("plain", tmp_path / "plain", None, 1, 4)
    attached = runs.lightning_run("infinity", tmp_path / "attached", tmp_path / "nvme", 1, 4)
    for i, what in enumerate(("grad norm", "lr", "loss")):
        _close([r[i] for r in plain["rows"]], [r[i] for r in attached["rows"]], what)
    _same_params(plain["params"], attached["params"], "one process")
    assert not torch.distributed.is_initialized()  # one process needs no process group


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"bf16": True}, "OffloadConfig.precision"),
        ({"torch_compile": True}, "compile"),
        ({"fsdp": "full_shard"}, "zero_stage"),
    ],
)
def test_trainer_refuses_what_cannot_work_on_the_store(tmp_path, setting, named):
    from infinity.integrations.hf import InfinityTrainer

    arguments = runs.trainer_arguments(tmp_path, 1, 2)
    for key, value in setting.items():
        setattr(arguments, key, value)  # as parsed; Trainer would act on it in __init__
    with pytest.raises(ConfigError, match=named):
        InfinityTrainer(model=runs.llama(), args=arguments, offload_config=infinity.OffloadConfig())


@pytest.mark.skipif(not LIGHTNING, reason="pytorch-lightning is not installed")
@pytest.mark.usefixtures("launch_environment_restored")
def test_lightning_refuses_its_own_mixed_precision(tmp_path):
    import pytorch_lightning as pl

    from infinity.integrations.lightning import InfinityStrategy

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        strategy=InfinityStrategy(runs.store_config(tmp_path)),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=1,
    )
    loader = torch.utils.data.DataLoader(runs.sequences(4), batch_size=4)
    with pytest.raises(ConfigError, match="OffloadConfig.precision"):
        trainer.fit(runs.lightning_module(), loader)


def test_integrations_refuse_an_unattached_model_and_foreign_precision(tmp_path):
    from infinity.integrations.accelerate import InfinityAccelerator
    from infinity.integrations.hf import InfinityTrainer

    with pytest.raises(AttachError, match="offload_config"):
        InfinityTrainer(model=runs.llama(), args=runs.trainer_arguments(tmp_path, 1, 2))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh process's accelerate
    try:
        with pytest.raises(ConfigError, match="OffloadConfig.precision"):
            InfinityAccelerator(cpu=True, mixed_precision="bf16")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_integrations_are_imported_only_when_used():
    frameworks = "{'transformers', 'accelerate', 'pytorch_lightning'}"
    code = f"import sys, infinity; assert not {frameworks} & set(sys.modules), sorted(sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from infinity.integrations import hf

    assert infinity.hf.InfinityTrainer is hf.InfinityTrainer  # the lazy alias
    if LIGHTNING:
        from infinity.integrations import lightning

        assert infinity.lightning.InfinityStrategy is lightning.InfinityStrategy
