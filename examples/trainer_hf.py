"""Hugging Face Trainer on an attached model: a small Llama (built from a config, nothing
downloaded) trained on synthetic counting sequences with parameters, gradients and Adam state on
NVMe. One process or several ranks, the script unchanged:

    python examples/trainer_hf.py
    torchrun --nproc-per-node 2 examples/trainer_hf.py
    accelerate launch --num_processes 2 examples/trainer_hf.py     # on GPUs

Swap files go to $INFINITY_NVME (default: a temporary directory); checkpoints to ./trainer-out
(``checkpoint-N/infinity`` is the store's, saved by every rank; resume with
``--resume checkpoint-N``).
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import transformers

import infinity
from infinity.integrations.hf import InfinityTrainer


class Counting(torch.utils.data.Dataset):
    """Each token the previous plus a per-sequence stride: learnable in a few steps."""

    def __init__(self, count: int, vocab: int = 256, length: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        stride = torch.randint(1, 4, (count, 1), generator=generator)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume", help="a checkpoint-N directory under --out")
    parser.add_argument("--out", default="trainer-out")
    cli = parser.parse_args()
    if "WORLD_SIZE" in os.environ and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before the store: cuda:LOCAL_RANK
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        # The store attaches before Trainer exists, so the process group comes first.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    store = infinity.TieredStore(
        infinity.OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=os.environ.get("INFINITY_NVME") or tempfile.mkdtemp(),
            host_budget="64MiB",
        )
    )
    # The two lines: attach, then give Trainer the optimizer attach returned.
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, cli.steps)
    args = transformers.TrainingArguments(
        output_dir=cli.out,
        max_steps=cli.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        logging_steps=5,
        save_strategy="steps",
        save_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = InfinityTrainer(
        model=model, args=args, train_dataset=Counting(1024), optimizers=(optimizer, scheduler)
    )
    resume = os.path.join(cli.out, cli.resume) if cli.resume else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(cli.out, "final"))  # safetensors: from_pretrained loads it
    store.close()


if __name__ == "__main__":
    main()
