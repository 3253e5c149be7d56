"""PyTorch Lightning with the store as its strategy: the LightningModule as usual, a small Llama
(from a config) on synthetic counting sequences, parameters, gradients and Adam state on NVMe.

    python examples/lightning_module.py                 # 2 processes on CPUs (or GPUs)
    python examples/lightning_module.py --resume PATH   # a checkpoint directory it saved

Swap files go to $INFINITY_NVME (default: a temporary directory); checkpoints to ./lightning-out.
"""

import argparse
import os
import tempfile

import pytorch_lightning as pl
import torch
import transformers
from pytorch_lightning.callbacks import ModelCheckpoint

import infinity
from infinity.integrations.lightning import InfinityStrategy


class Counting(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=256,
                hidden_size=128,
                intermediate_size=512,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=64,
            )
        )

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.net(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 2))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume")
    cli = parser.parse_args()
    nvme = os.environ.get("INFINITY_NVME") or tempfile.gettempdir()
    config = infinity.OffloadConfig(
        offload_param="nvme", offload_optimizer="nvme", nvme_path=nvme, host_budget="64MiB"
    )
    generator = torch.Generator().manual_seed(0)
    tokens = (
        torch.randint(0, 256, (1024, 1), generator=generator)
        + torch.randint(1, 4, (1024, 1), generator=generator) * torch.arange(32)
    ) % 256
    trainer = pl.Trainer(
        strategy=InfinityStrategy(config),
        devices=2,
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        max_steps=cli.steps,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath="lightning-out", every_n_train_steps=10)],
    )
    loader = torch.utils.data.DataLoader(tokens, batch_size=8)
    trainer.fit(Counting(), loader, ckpt_path=cli.resume)


if __name__ == "__main__":
    main()
