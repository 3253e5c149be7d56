"""infinity-plan's arguments: the parser and the converters of its flags' values."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from infinity.cli import plan_validation
from infinity.cli.common.args import UserError, config_size, positive
from infinity.cli.plan_models import OPTIMIZERS
from infinity.planning import planner
from infinity.planning.simulated_time import Contention, ContentionError


def gbps_pair(text: str) -> tuple[float, float, float | None]:
    """--disk-gbps READ,WRITE[,COMBINED] (one number: read and write alike)."""
    parts = [p for p in text.split(",") if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) not in (1, 2, 3) or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected READ,WRITE in GB/s such as 3.5,2.8 (or one number for both), and "
            f"optionally the combined GB/s of reading and writing at once (3.5,2.8,2.4), got "
            f"{text!r}"
        )
    return (values[0], values[1 if len(values) > 1 else 0], values[2] if len(values) == 3 else None)


def given_contention(text: str | None) -> Contention | str | None:
    """--contention: None (not measured), "measure", or the figures given."""
    if text is None or text.strip() == "measure":
        return None if text is None else "measure"
    try:
        slowdown, retained = (float(p) for p in text.split(","))
        return Contention(slowdown, retained, source="--contention")
    except (ValueError, ContentionError) as exc:
        raise UserError(
            f"--contention expects 'measure' or SLOWDOWN,RETAINED such as 1.3,0.8 (compute "
            f"beside the disk over alone, >= 1; the disk's share of its GB/s kept beside "
            f"compute, in (0, 1]), got {text!r}"
            + (f": {exc}" if isinstance(exc, ContentionError) else "")
        ) from exc


def _counts(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected counts >= 1 such as 1,2,4, got {text!r}")
    return values


def _sizes(text: str) -> list[int]:
    return [config_size(p.strip()) for p in text.split(",") if p.strip()]


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def convert(text: str) -> list[str]:
        items = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in items if p not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}"
            )
        return items

    return convert


def build_parser(doc: str) -> argparse.ArgumentParser:
    """The parser, its description and epilog from ``doc`` (the command's docstring)."""
    parser = argparse.ArgumentParser(
        prog="infinity-plan",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n\n", 1)[1],
    )
    add = parser.add_argument
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--hf-config",
        type=Path,
        metavar="DIR_OR_JSON",
        help="a Hugging Face config: a model directory with config.json, or the "
        "JSON file (built with AutoModelForCausalLM.from_config)",
    )
    model.add_argument(
        "--module", metavar="PKG.MOD:CALLABLE", help="a module class or factory, called with --args"
    )
    add(
        "--args",
        default="{}",
        metavar="JSON",
        help="keyword arguments of --module as a JSON object (a single dataclass argument, such "
        "as infinity.cli.common.tiny_gpt:TinyGPT's GPTConfig, is built from them)",
    )
    add("--batch", type=positive(int), default=1, help="sequences per step (%(default)s)")
    add(
        "--seq-len",
        type=positive(int),
        help="tokens per sequence (default: 128 for a language model; none for --module "
        "models taking a (batch, features) input)",
    )
    add("--optimizer", choices=tuple(OPTIMIZERS), default="adamw", help="(%(default)s)")
    add(
        "--disk",
        metavar="BENCH_JSON|measure",
        help="the drive's profile: infinity-bench --json output, or 'measure': measured here on "
        "the swap directory in each candidate's own requests (buffer_size bytes, buffer_count "
        "in flight), about a second per request shape",
    )
    add(
        "--disk-gbps",
        type=gbps_pair,
        metavar="READ,WRITE[,COMBINED]",
        help="the drive's profile as GB/s (10**9 bytes/s) read and write, and optionally both "
        "directions' bytes per second while reading and writing at once (bench_overlap's "
        "combined pass); below what the two alone imply, the disk is slowed to it while both "
        "directions are in flight",
    )
    add(
        "--drives",
        type=_counts,
        default=[1],
        metavar="N[,N...]",
        help="drives striped together (nvme_path entries), each as --disk; several counts "
        "give one table each, from one recording (1)",
    )
    add(
        "--disk-shared",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reads and writes share the drives' bandwidth (most NVMe drives under mixed load; "
        "default) or run side by side",
    )
    add(
        "--contention",
        default=None,
        metavar="measure|SLOWDOWN,RETAINED",
        help="how compute and the disk slow each other on the machine planned for: 'measure' "
        "times the model's plain step here alone and beside the engine streaming on the swap "
        "directory; or the compute's slowdown beside the disk (>= 1) and the share of the "
        "disk's GB/s kept beside compute (0-1]. Default: not measured, taken as none (on few "
        "cores streaming candidates then come out optimistic)",
    )
    add(
        "--device-profile",
        default="this machine",
        metavar="NAME",
        help=f"where the modules compute: 'this machine' or one of {', '.join(planner.GPU_PRESETS)}"
        " (%(default)s)",
    )
    add(
        "--ranks",
        type=positive(int),
        default=1,
        help="data-parallel ranks (GPUs) under ZeRO-3: each holds and moves 1/N of the state "
        "(%(default)s)",
    )
    add(
        "--own-drives",
        action="store_true",
        help="each rank has --drives drives of its own (default: the ranks share them)",
    )
    add(
        "--host-ram",
        type=config_size,
        metavar="SIZE",
        help="host memory the run may use, all ranks together (default: this machine's)",
    )
    add(
        "--device-mem",
        type=config_size,
        metavar="SIZE",
        help="device memory per rank (default: the GPU preset's; this machine: --host-ram)",
    )
    add(
        "--host-budget",
        type=_sizes,
        metavar="SIZE[,SIZE...]",
        help="host_budget values to consider instead of the grid's (fractions of --host-ram)",
    )
    add(
        "--device-budget",
        type=_sizes,
        metavar="SIZE[,SIZE...]",
        help="device_budget values to consider instead of the grid's",
    )
    add(
        "--buffer-size",
        type=_sizes,
        metavar="SIZE[,SIZE...]",
        help="buffer_size values to consider instead of the grid's",
    )
    add(
        "--precision",
        type=_choices(("fp32", "bf16", "fp16")),
        help="compute dtypes to consider (default: bf16 on a GPU profile, fp32 here)",
    )
    add(
        "--offload-param",
        type=_choices(("nvme", "cpu", "none")),
        default=["nvme", "cpu", "none"],
        help="offload_param values to consider (nvme,cpu,none)",
    )
    add(
        "--offload-optimizer",
        type=_choices(("nvme", "cpu")),
        default=["nvme", "cpu"],
        help="offload_optimizer values to consider (nvme,cpu)",
    )
    add(
        "--max-local-params",
        type=float,
        default=200e6,
        metavar="N",
        help="train a scaled-down copy instead of the model beyond this many parameters "
        "(%(default).0f)",
    )
    add("--scaled", action="store_true", help="use a scaled-down copy whatever the model's size")
    add(
        "--scaled-layers",
        type=positive(int),
        default=2,
        help="layers per layer stack of the scaled-down copy (%(default)s)",
    )
    add("--steps", type=int, default=3, help="training steps recorded here, >= 2 (%(default)s)")
    add(
        "--optimizer-gelems",
        type=positive(float),
        metavar="RATE",
        help="the CPU optimizer's update rate per rank, in 10**9 elements/s (default: measured "
        "here)",
    )
    add(
        "--nvme-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="swap directory for the recorded steps (default: a temporary one) and the "
        "written config's nvme_path (repeat for several drives)",
    )
    add("--top", type=positive(int), default=12, help="candidates shown (%(default)s)")
    add(
        "--write-config",
        type=Path,
        metavar="JSON",
        help="write the best candidate as a config file OffloadConfig.from_file loads",
    )
    add("--json", type=Path, metavar="FILE", help="write every candidate's prediction as JSON")
    add(
        "--validate",
        type=positive(int),
        nargs="?",
        const=plan_validation.DEFAULT_STEPS,
        metavar="STEPS",
        help=f"then run the best candidate that fits here, {plan_validation.WARMUP} warm-up "
        f"steps and STEPS measured ({plan_validation.DEFAULT_STEPS}), and print predicted "
        "against measured step time, bytes per step and peak RSS "
        "(one process, this machine, the model itself: not with --ranks > 1, a GPU "
        "--device-profile or a scaled-down copy)",
    )
    add("-v", "--verbose", action="store_true", help="log the runtime's INFO messages")
    return parser


# ---------------------------------------------------------------------------- candidates
