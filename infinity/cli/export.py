"""``infinity-export CKPT OUT``: a checkpoint written by ``store.save_checkpoint`` out as
consolidated Hugging Face safetensors (``from_pretrained(OUT)`` loads it when the checkpoint has
the model's config.json, or when you copy it there). One output file in memory at a time.

    infinity-export runs/step-1000 exported/ [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infinity.checkpointing.export import DTYPES, export_checkpoint
from infinity.config import parse_size
from infinity.errors import InfinityError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a directory save_checkpoint wrote")
    parser.add_argument("out", type=Path, help="where the safetensors files go")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="dtype of the exported weights (default fp32, the masters')",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest output file (as Hugging Face counts: 5GB = 5e9 bytes)",
    )
    args = parser.parse_args(argv)
    try:
        limit = parse_size(args.max_shard_size, name="--max-shard-size")
        files = export_checkpoint(args.checkpoint, args.out, args.dtype, limit)
    except InfinityError as exc:
        print(f"infinity-export: {exc}", file=sys.stderr)
        return 1
    total = sum(f.stat().st_size for f in files)
    print(f"exported {args.checkpoint} to {args.out}: {len(files)} files, {total / 1e6:.1f} MB")
    for file in files:
        print(f"  {file.name}")
    if not (args.out / "config.json").exists():
        print(
            "  (no config.json in the checkpoint: copy the model's config there for "
            "from_pretrained)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
