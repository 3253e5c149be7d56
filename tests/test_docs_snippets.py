"""The docs' code blocks run: every ```python block of docs/**/*.md is executed in a fresh process
from an empty directory, with the README's helpers (tests/test_readme_snippets.py), so a renamed
argument, a moved import or a changed return value fails here instead of in a reader's hands.

What a block needs is said on the line right before its fence, in an HTML comment (the page
renders it as nothing; an info string after ```python would break the fence in mkdocs):

- nothing: the block runs as written, imports and all.
- ``<!-- prelude: NAME[, NAME...] -->``: the block is a fragment using what the page's text says
  the reader already has (their model, optimizer, loader, an attached store, a checkpoint
  directory, a ds_config.json, torchrun's ranks). The script runs ``PRELUDES[NAME]`` for each
  name, in order, and then the block unchanged. The preludes are small stand-ins for those
  things: a two-layer model, a few batches, a 2-layer Llama of 64 wide, a store on the CPU in a
  temporary directory under a 64 MiB host budget, so each block runs in seconds.
- ``<!-- no-run: why -->``: the block cannot run on a CPU machine without network (a CUDA device,
  a hub model); ``python_blocks`` leaves it out, and the page's text says why. Kept rare.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_readme_snippets import ROOT, python_blocks, run_block

DOCS = ROOT / "docs"
PRELUDE = re.compile(r"<!--\s*prelude:\s*([\w, -]+?)\s*-->\s*$")

_IMPORTS = """\
import tempfile
from pathlib import Path

import torch
from torch import nn

import infinity
"""

PRELUDES: dict[str, str] = {
    # The reader's model (a head, as the gathered example names), optimizer, batches and loss.
    "model": """\
class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU())
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        return self.head(self.body(x))


model = MyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = [(torch.randn(8, 32), torch.randn(8, 32)) for _ in range(3)]
loss_fn = nn.functional.mse_loss
warmup = lambda step: min(1.0, (step + 1) / 100)
""",
    # The store's config as a page's text has it before the block.
    "config": """\
config = infinity.OffloadConfig(
    device="cpu",
    offload_param="nvme",
    offload_optimizer="nvme",
    nvme_path=tempfile.mkdtemp(),
    host_budget="64MiB",
)
""",
    "store": """\
store = infinity.TieredStore(config)
""",
    # model + config + store, attached, two steps done with the timeline on (as predict and the
    # timeline's exports want), a scheduler and the step count.
    "attached": """\
model, optimizer = store.attach(model, optimizer)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
store.timeline.enabled = True
for step, (x, y) in enumerate(loader[:2]):
    loss_fn(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
""",
    # A Hugging Face causal LM saved where the pages say "path/to/model", its config and inputs.
    "hf-model": """\
import accelerate
import transformers

hf_config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=128,
)
model = transformers.LlamaForCausalLM(hf_config)
model.save_pretrained("path/to/model")
input_ids = torch.randint(0, 256, (2, 8))
data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 256, (16, 16))]
loader = torch.utils.data.DataLoader(data, batch_size=8)
warmup = lambda step: min(1.0, (step + 1) / 100)
""",
    "trainer-args": """\
max_steps = 2
args = transformers.TrainingArguments(
    output_dir="out", max_steps=max_steps, per_device_train_batch_size=8, report_to=[],
    use_cpu=True, save_strategy="no",
)
""",
    # A DeepSpeed config as HF Trainer users have it: "auto" placeholders, NVMe offload.
    "ds-config": """\
import json

swap = tempfile.mkdtemp()
Path("ds_config.json").write_text(json.dumps({
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": swap},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap},
        "stage3_prefetch_bucket_size": "auto",
    },
    "bf16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}))
""",
    # A GPT whose forward returns the loss, built from its config, and token batches.
    "gpt": """\
class MyGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config["vocab"], config["width"])
        width = config["width"]
        self.blocks = nn.Sequential(*[nn.Linear(width, width) for _ in range(2)])
        self.head = nn.Linear(config["width"], config["vocab"])

    def forward(self, tokens, targets):
        logits = self.head(self.blocks(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


config = {"vocab": 128, "width": 32}
loader = [(torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16))) for _ in range(2)]
""",
    # The elastic loop's job: its length, its data's sampler, a node-local swap directory.
    "elastic": """\
Path("nvme/swap").mkdir(parents=True)
total_steps, steps_per_epoch = 1001, 100
dataset = list(range(steps_per_epoch))
sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0)
""",
    # torchrun --nproc-per-node 2 on gloo: the script starts itself as two ranks (the first thing
    # it does: see _LAUNCHERS).
    "torchrun-2": """\
import os
import socket
import subprocess
import sys

if "RANK" not in os.environ:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [
        subprocess.Popen([sys.executable, __file__], env={
            **os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        })
        for r in range(2)
    ]
    sys.exit(max(rank.wait(timeout=120) for rank in ranks))

import torch.distributed as dist
""",
    # A LightningModule (one optimizer from configure_optimizers) and its batches.
    "lightning": """\
import pytorch_lightning as pl


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


module = Module()
pairs = [(x, y) for x, y in zip(torch.randn(16, 32), torch.randn(16, 32))]
loader = torch.utils.data.DataLoader(pairs, batch_size=8)
""",
}


_LAUNCHERS = {"torchrun-2"}


def prelude_names(path: Path, block_id: str) -> list[str]:
    """The preludes named on the line before the fence of ``block_id`` (``name:line``)."""
    fence_line = int(block_id.rsplit(":", 1)[1])
    before = path.read_text().splitlines()[fence_line - 2] if fence_line > 1 else ""
    match = PRELUDE.match(before.strip())
    return [] if match is None else [n.strip() for n in match.group(1).split(",")]


def docs_blocks() -> list[tuple[str, str]]:
    """(an id naming the page and line, the script: preludes then the block) of each runnable
    ```python block of the docs."""
    scripts = []
    for path in sorted(DOCS.rglob("*.md")):
        for block_id, code in python_blocks(path):
            names = prelude_names(path, block_id)
            # a launcher starts the ranks before anything heavy is imported; an unknown name
            # adds nothing here, and test_every_docs_block_runs_or_says_why_not names it
            launch = [PRELUDES.get(name, "") for name in names if name in _LAUNCHERS]
            preludes = [PRELUDES.get(name, "") for name in names if name not in _LAUNCHERS]
            head = "".join(launch + [_IMPORTS] + preludes) if names else ""
            scripts.append((str(path.relative_to(DOCS).with_name(block_id)), head + code))
    return scripts


DOCS_BLOCKS = docs_blocks()


def fences(text: str) -> int:
    return len(re.findall(r"^```python", text, re.MULTILINE))


def test_every_docs_block_runs_or_says_why_not():
    """Each ```python fence either runs here or is marked no-run with a reason; the no-run ones
    stay few, and every prelude a page names exists."""
    total = no_run = 0
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text()
        total += fences(text)
        no_run += len(re.findall(r"^<!--\s*no-run:\s*\S[^\n]*-->\n```python", text, re.MULTILINE))
        for line in text.splitlines():
            match = PRELUDE.match(line.strip())
            if match is not None:
                unknown = {n.strip() for n in match.group(1).split(",")} - PRELUDES.keys()
                assert not unknown, f"{path.name} names unknown preludes {unknown}"
    assert total >= 15, "the docs' code blocks were not found"
    assert len(DOCS_BLOCKS) + no_run == total, "a block marked no-run gives no reason"
    assert no_run <= 2, f"{no_run} blocks do not run: make them runnable with a prelude"


def test_the_comment_before_a_fence_names_its_preludes_or_leaves_it_out(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- prelude: model, config -->\n```python\nprint(1)\n```\n\n"
        "<!-- no-run: needs a CUDA device -->\n```python\nprint(2)\n```\n\n"
        "```python\nprint(3)\n```\n"
    )
    (first, _), (last, code) = python_blocks(page)
    assert prelude_names(page, first) == ["model", "config"]
    assert prelude_names(page, last) == [] and code == "print(3)\n"


@pytest.mark.slow
@pytest.mark.parametrize("code", [c for _, c in DOCS_BLOCKS], ids=[i for i, _ in DOCS_BLOCKS])
def test_docs_block_runs(snippet_runner, tmp_path, code):
    done = run_block(snippet_runner, code, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
