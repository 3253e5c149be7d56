"""Short runs of Hugging Face Trainer, an accelerate loop and Lightning on a tiny Llama, each with
the store (through ``infinity.integrations``) or without it (the framework as it is: DDP across
ranks), returning what they logged and the parameters they ended with. Used in one process and
on each rank of tests/test_trainer_integrations.py; every run starts from the same seed-0 model
and the same data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import infinity

VOCAB, CONTEXT = 128, 16
LR, CLIP, ACCUMULATE = 1e-2, 0.5, 2
#: the store under every run: parameters, gradients and Adam state on NVMe through an arena
#: smaller than the state, so shards really go to the swap files and come back
NVME = {
    "offload_param": "nvme",
    "offload_optimizer": "nvme",
    "buffer_size": 8 << 10,
    "buffer_count": 16,
    "device": "cpu",
}


def llama(lora: bool = False, dropout: float = 0.0) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * CONTEXT,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
        attention_dropout=dropout,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
    return model


def sequences(count: int, seed: int = 1) -> torch.Tensor:
    """Counting sequences (each token the previous plus a per-sequence stride, mod the
    vocabulary) from random starts: learnable, so losses fall within a few steps."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + stride * torch.arange(CONTEXT)) % VOCAB


class Sequences(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int = 1) -> None:
        self.tokens = sequences(count, seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    # fused: what the store runs for default-options AdamW; the plain runs use the same kernel.
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True)


def store_config(nvme: Path, **changes: Any) -> infinity.OffloadConfig:
    nvme.mkdir(parents=True, exist_ok=True)
    return infinity.OffloadConfig(nvme_path=str(nvme), **{**NVME, **changes})


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values (across ranks, each read is a collective: every rank calls)."""
    return {name: p.detach().clone().cpu() for name, p in model.named_parameters()}


# -- Hugging Face Trainer ----------------------------------------------------------------------
def trainer_arguments(
    out: Path, steps: int, batch: int, arguments_class: Any = None, **changes: Any
) -> Any:
    """The runs' TrainingArguments (or ``arguments_class``: a subclass's, such as SFTConfig)."""
    import transformers

    settings: dict[str, Any] = dict(
        output_dir=str(out),
        use_cpu=True,
        seed=0,
        max_steps=steps,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE,
        max_grad_norm=CLIP,
        learning_rate=LR,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
    )
    settings.update(changes)
    return (arguments_class or transformers.TrainingArguments)(**settings)


def hf_run(
    kind: str,
    out: Path,
    nvme: Path | None = None,
    steps: int = 8,
    batch: int = 2,
    resume: Path | None = None,
    export: bool = False,
    dropout: float = 0.0,
    store_changes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``kind`` "plain": transformers.Trainer on the model (DDP across ranks); "infinity": the
    model attached first, then InfinityTrainer. AdamW and a warmup-then-linear schedule built by
    the script, as the README's recipe does. Returns the logged loss, grad_norm and learning
    rate of each step, the evaluation losses and the final parameters; with ``export``,
    ``trainer.save_model(out / "export")`` is called last (on every rank). ``dropout``: the
    attention's; ``store_changes``: fields of the store's config changed from the runs'."""
    import transformers

    from infinity.integrations.hf import InfinityTrainer

    model = llama(dropout=dropout)
    optimizer = fused_adamw(model.parameters())
    store = None
    if kind == "infinity":
        assert nvme is not None
        store = infinity.TieredStore(store_config(nvme, **(store_changes or {})))
        model, optimizer = store.attach(model, optimizer)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, 8)
    trainer_class = InfinityTrainer if kind == "infinity" else transformers.Trainer
    trainer = trainer_class(
        model=model,
        args=trainer_arguments(out, steps, batch),
        train_dataset=Sequences(64),
        eval_dataset=Sequences(8, seed=2),
        optimizers=(optimizer, scheduler),
    )
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
        history = trainer.state.log_history
        result = {
            "steps": [e["step"] for e in history if "loss" in e],
            "loss": [e["loss"] for e in history if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in history if "loss" in e],
            "lr": [e["learning_rate"] for e in history if "loss" in e],
            "eval_loss": [e["eval_loss"] for e in history if "eval_loss" in e],
            "wrapped": type(trainer.model_wrapped).__name__,
            "params": parameters(model),
        }
        if export:
            trainer.save_model(str(out / "export"))
    finally:
        if store is not None:
            store.close()
    return result


def hf_lora_run(out: Path, nvme: Path) -> dict[str, Any]:
    """A peft LoRA model given to InfinityTrainer with ``offload_config`` (Trainer builds its
    optimizer over the adapter, then attaches), gradient checkpointing on. Returns the NVMe
    writes after attach per kind of shard, the adapter before and after, and what save_model
    wrote."""
    import transformers

    from infinity.integrations.hf import InfinityTrainer

    model = llama(lora=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    writes: dict[str, int] = {}

    class CountWrites(transformers.TrainerCallback):
        """From the first step on (after attach), the store's transfers are recorded."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trainer.store.timeline.enabled = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timeline = trainer.store.timeline
            timeline.enabled = False
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            for transfer in timeline.transfers:
                if transfer.op != "write":
                    continue
                name = transfer.shard.split("#")[0].split("@")[0]
                kind = "frozen" if name in frozen else "trainable"
                writes[kind] = writes.get(kind, 0) + transfer.nbytes

    arguments = trainer_arguments(
        out, 4, 2, eval_strategy="no", save_strategy="no", gradient_checkpointing=True
    )
    # A small arena: frozen shards are evicted and read again, the adapter's are written back.
    config = store_config(nvme, buffer_count=6)
    trainer = InfinityTrainer(
        model=model,
        args=arguments,
        train_dataset=Sequences(32),
        offload_config=config,
        callbacks=[CountWrites()],
    )
    try:
        trainer.train()
        trainer.save_model(str(out / "adapter"))
        after = parameters(model)
    finally:
        trainer.store.close()
    return {
        "writes": writes,
        "changed": sorted(n for n, v in after.items() if not torch.equal(v, before[n])),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "saved": sorted(p.name for p in (out / "adapter").iterdir()),
        "loss": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


# -- Trainer subclasses: Seq2SeqTrainer, TRL's SFTTrainer ------------------------------------------
def t5() -> torch.nn.Module:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


class Pairs(torch.utils.data.Dataset):
    """Each counting sequence's first half as the source, its second half as the target."""

    def __init__(self, count: int, seed: int = 1) -> None:
        self.tokens = sequences(count, seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        half = CONTEXT // 2
        return {"input_ids": self.tokens[index][:half], "labels": self.tokens[index][half:]}


def seq2seq_run(kind: str, out: Path, nvme: Path | None = None) -> dict[str, Any]:
    """Seq2SeqTrainer ("plain", DDP across ranks) or InfinitySeq2SeqTrainer on an attached T5:
    6 steps, evaluated twice and then predicting with generate (across ranks every rank runs
    the same forwards: synced_gpus). Returns losses, grad norms, evaluation losses, the
    generated tokens and the final parameters."""
    import transformers

    from infinity.integrations.hf import InfinitySeq2SeqTrainer

    model = t5()
    optimizer = fused_adamw(model.parameters())
    store = None
    trainer_class: Any = transformers.Seq2SeqTrainer
    if kind == "infinity":
        assert nvme is not None
        store = infinity.TieredStore(store_config(nvme))
        model, optimizer = store.attach(model, optimizer)
        trainer_class = InfinitySeq2SeqTrainer
    arguments = trainer_arguments(
        out,
        6,
        2,
        transformers.Seq2SeqTrainingArguments,
        eval_steps=3,
        save_strategy="no",
        predict_with_generate=True,
        generation_max_length=CONTEXT // 2,
    )
    trainer = trainer_class(
        model=model,
        args=arguments,
        train_dataset=Pairs(64),
        eval_dataset=Pairs(8, seed=2),
        optimizers=(optimizer, None),
    )
    try:
        trainer.train()
        predicted = trainer.predict(Pairs(4, seed=3)).predictions
        history = trainer.state.log_history
        return {
            "loss": [e["loss"] for e in history if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in history if "loss" in e],
            "eval_loss": [e["eval_loss"] for e in history if "eval_loss" in e],
            "generated": torch.as_tensor(predicted),
            "params": parameters(model),
        }
    finally:
        if store is not None:
            store.close()


def tokenizer() -> Any:
    """A word-level tokenizer over the counting vocabulary, built here (SFTTrainer wants a
    processing class, and tests download nothing)."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = Tokenizer(WordLevel({str(i): i for i in range(VOCAB)}, unk_token="3"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="0", bos_token="1", eos_token="2", unk_token="3"
    )


def sft_run(kind: str, out: Path, nvme: Path | None = None) -> dict[str, Any]:
    """TRL's SFTTrainer as it is ("plain") or with_store(SFTTrainer) on an attached Llama, on
    pre-tokenized counting sequences, 6 steps. SFTConfig turns bf16 on by default; the store's
    precision decides instead, so both runs set it off."""
    import datasets
    import trl

    from infinity.integrations.hf import with_store

    model = llama()
    optimizer = fused_adamw(model.parameters())
    store = None
    trainer_class: Any = trl.SFTTrainer
    if kind == "infinity":
        assert nvme is not None
        store = infinity.TieredStore(store_config(nvme))
        model, optimizer = store.attach(model, optimizer)
        trainer_class = with_store(trl.SFTTrainer)
    arguments = trainer_arguments(
        out, 6, 2, trl.SFTConfig, eval_strategy="no", save_strategy="no", bf16=False
    )
    trainer = trainer_class(
        model=model,
        args=arguments,
        train_dataset=datasets.Dataset.from_dict({"input_ids": sequences(64).tolist()}),
        processing_class=tokenizer(),
        optimizers=(optimizer, None),
    )
    try:
        trainer.train()
        history = trainer.state.log_history
        return {
            "loss": [e["loss"] for e in history if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in history if "loss" in e],
            "params": parameters(model),
        }
    finally:
        if store is not None:
            store.close()


# -- accelerate ------------------------------------------------------------------------------------
def accelerate_run(kind: str, out: Path, nvme: Path | None = None) -> dict[str, Any]:
    """A loop as an accelerate user writes it: prepare(model, optimizer, loader, scheduler),
    accumulate over two micro-batches, backward, clip_grad_norm_, gather of the loss; save_state
    after step 2, and after step 4 load_state and train steps 3 and 4 again. ``kind``:
    "plain" (accelerate.Accelerator: DDP across ranks) or "infinity" (attached,
    InfinityAccelerator)."""
    import accelerate

    from infinity.integrations.accelerate import InfinityAccelerator

    model = llama()
    optimizer = fused_adamw(model.parameters())
    store = None
    accelerator_class = InfinityAccelerator if kind == "infinity" else accelerate.Accelerator
    accelerator = accelerator_class(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    if kind == "infinity":
        assert nvme is not None
        store = infinity.TieredStore(store_config(nvme))
        model, optimizer = store.attach(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    loader = torch.utils.data.DataLoader(sequences(64), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    module = accelerator.unwrap_model(model)
    batches = list(loader)  # this rank's
    rows: list[tuple[float, float]] = []

    def steps(first: int, last: int) -> None:
        for step in range(first, last + 1):
            for micro in range(ACCUMULATE):
                batch = batches[(step - 1) * ACCUMULATE + micro]
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            mean = accelerator.gather(loss.detach()[None]).mean()
            rows.append((float(norm), float(mean)))

    try:
        steps(1, 2)
        accelerator.save_state(str(out))
        steps(3, 4)
        params = parameters(module)
        accelerator.load_state(str(out))
        steps(3, 4)
        result = {
            "rows": rows,
            "params": params,
            "again": parameters(module),
            "prepared": type(model).__name__,
            "saved": sorted(p.name for p in out.iterdir()),
        }
    finally:
        if store is not None:
            store.close()
    return result


# -- Lightning -------------------------------------------------------------------------------------
def lightning_module(dropout: float = 0.0) -> Any:
    """The LightningModule of the Lightning runs: the tiny Llama, its loss logged across ranks,
    AdamW and a per-step StepLR from configure_optimizers."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = llama(dropout=dropout)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            loss = self.net(input_ids=batch, labels=batch).loss
            self.log("loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: torch.Tensor, index: int) -> None:
            self.log("val_loss", self.net(input_ids=batch, labels=batch).loss, sync_dist=True)

        def configure_optimizers(self) -> Any:
            optimizer = fused_adamw(self.parameters())
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    return Module()


def lightning_run(
    kind: str,
    out: Path,
    nvme: Path | None,
    devices: int,
    steps: int,
    resume: Path | None = None,
    dropout: float = 0.0,
    store_changes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A LightningModule as users write it (configure_optimizers returns AdamW and a per-step
    StepLR), gradient_clip_val, accumulate_grad_batches=2, epochs of 4 steps (so a checkpoint at
    step 4 resumes exactly: Lightning restarts a dataloader cut mid-epoch from its start), a
    validation at the end of each and a ModelCheckpoint every 2 steps; ``kind`` "plain"
    (Lightning's own strategy: DDP across ranks) or "infinity" (InfinityStrategy). In one
    process the loader is used as it is (across ranks Lightning's distributed sampler shuffles
    it). Returns per step the gradient norm before clipping, the learning rate and the loss, the
    validation loss and the final parameters."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from infinity.integrations.lightning import InfinityStrategy

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[list[float]] = []

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
            self.rows.append([norm, optimizer.param_groups[0]["lr"]])

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            if self.rows and len(self.rows[-1]) == 2:
                self.rows[-1].append(float(outputs["loss"]))

    module = lightning_module(dropout)
    record = Record()
    if kind == "infinity":
        assert nvme is not None
        strategy: Any = InfinityStrategy(store_config(nvme, **(store_changes or {})))
    else:
        strategy = "ddp" if devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=CLIP,
        accumulate_grad_batches=ACCUMULATE,
        num_sanity_val_steps=0,
        use_distributed_sampler=devices > 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            record,
            ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1),
        ],
    )
    loader = torch.utils.data.DataLoader(sequences(32), batch_size=4 // devices)
    validation = torch.utils.data.DataLoader(sequences(8, seed=2), batch_size=4 // devices)
    trainer.fit(module, loader, validation, ckpt_path=str(resume) if resume else None)
    result = {
        "rows": record.rows,
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
        "params": parameters(module),  # attached after fit (InfinityStrategy): read through
        "checkpoints": sorted(p.name for p in out.iterdir()),
        "global_step": trainer.global_step,
    }
    if kind == "infinity":
        trainer.validate(module, validation)  # the module as fit left it, still attached
        result["validated"] = float(trainer.callback_metrics["val_loss"])
        trainer.strategy.close()  # the module's values back as plain tensors
        result["closed"] = parameters(module)
    return result


def set_rank_environment(rank: int, world: int) -> None:
    """What torchrun sets, for the frameworks' own launch detection in a spawned rank."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
