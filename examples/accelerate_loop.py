"""An accelerate loop on an attached model: the script changes one line, the accelerator's
class. A small Llama (from a config) on synthetic counting sequences, parameters, gradients and
Adam state on NVMe; accumulation, clipping, save_state/load_state and gather as usual.

    python examples/accelerate_loop.py
    torchrun --nproc-per-node 2 examples/accelerate_loop.py
    accelerate launch --num_processes 2 examples/accelerate_loop.py   # on GPUs

Swap files go to $INFINITY_NVME (default: a temporary directory); the state to ./accelerate-out.
"""

import os
import tempfile

import torch
import transformers

import infinity
from infinity.integrations.accelerate import InfinityAccelerator


def main() -> None:
    # was accelerate.Accelerator(...); on CPUs, cpu=True makes a torchrun launch multi-process
    accelerator = InfinityAccelerator(
        cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2
    )
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
            host_budget="64MiB",  # device "auto": this rank's GPU (accelerate set it), else CPU
        )
    )
    model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 2))
    generator = torch.Generator().manual_seed(0)
    tokens = (
        torch.randint(0, 256, (512, 1), generator=generator)
        + torch.randint(1, 4, (512, 1), generator=generator) * torch.arange(32)
    ) % 256
    loader = torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        mean = accelerator.gather(loss.detach()[None]).mean()
        if accelerator.sync_gradients and step % 10 == 1:
            accelerator.print(f"micro-batch {step}: loss {mean:.3f}, grad norm {norm:.3f}")
        if step == 20:
            accelerator.save_state("accelerate-out")  # the store's checkpoint in it, every rank
    accelerator.load_state("accelerate-out")
    store.close()


if __name__ == "__main__":
    main()
