"""infinity-plan's results and how they print: the candidates, ranked per disk profile, as a
table and as JSON (infinity/cli/plan.py makes them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from infinity import OffloadConfig
from infinity.planning.planner import DiskProfile

GB = 1e9
#: stats()["update_mode"] in the table's words
UPDATE_MODES = {"in backward": "backward", "in optimizer.step()": "step"}


@dataclass
class Candidate:
    """One configuration and its prediction, or why it does not fit."""

    config: OffloadConfig
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: str = ""  # why it does not fit; empty when it does
    bound: str = ""
    busy: dict[str, float] = dataclasses.field(default_factory=dict)
    #: its own disk profile, where measured per candidate (--disk measure); else the table's
    disk: DiskProfile | None = None

    @property
    def fits(self) -> bool:
        return not self.reason


@dataclass
class Table:
    """The candidates on one disk profile, best first."""

    drives: int
    disk: DiskProfile
    ranked: list[Candidate]


@dataclass
class Plan:
    """What run() worked out: the header lines, one table per drive count, the JSON."""

    header: list[tuple[str, str]]
    tables: list[Table]
    tokens: int
    ranks: int
    json: dict[str, Any]
    #: the recording's replay for a configuration on a disk profile, over a number of
    #: iterations (planner.simulate with this plan's recording and device)
    replay: Callable[[OffloadConfig, DiskProfile, int], dict[str, Any]] | None = None

    @property
    def ranked(self) -> list[Candidate]:
        """The first table's candidates."""
        return self.tables[0].ranked


def candidate_json(c: Candidate, tokens: int) -> dict[str, Any]:
    return {
        "config": c.config.to_dict(),
        "fits": c.fits,
        "reason": c.reason,
        "bound": c.bound,
        "busy_seconds": c.busy,
        "tokens_per_second": tokens / c.result["step_seconds"] if c.fits else None,
        **{k: v for k, v in c.result.items() if k not in ("disk", "device")},
        **({"disk": dataclasses.asdict(c.disk)} if c.disk is not None else {}),
    }


def update_mode_text(mode: str | None) -> str:
    """A prediction's update_mode in the table's words."""
    return UPDATE_MODES.get(mode or "", mode or "-")


def size_text(nbytes: int | None) -> str:
    if nbytes is None:
        return "auto"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes} B"


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.3g}"


def table(plan: Plan, top: int) -> list[str]:
    lines = [f"{name:<10} {value}" for name, value in plan.header]
    for t in plan.tables:
        disk = t.disk
        lines += [
            "",
            f"{'disk':<10} {t.drives} drive(s): {disk.read_gbps:.3g} GB/s read, "
            f"{disk.write_gbps:.3g} GB/s write"
            + (f", {disk.combined_gbps:.3g} GB/s both at once" if disk.combined_gbps else "")
            + f"{', shared' if disk.shared else ', side by side'} per rank "
            f"({disk.source})",
            "",
        ]
        lines += _ranked_lines(plan, t.ranked, top)
    lines += [
        "",
        "per rank: bytes per step, peaks of each tier (host: the store's host tier) and "
        "of the process's RSS; disk: what the swap files hold (the preflight's bytes, "
        "checked against the free space at attach); bound: the resource busiest in a "
        "step; updates: where step_in_backward='auto' runs them (in backward, or in "
        "optimizer.step() where the arena has no room for them there). Not modelled: "
        "activations' memory, all-gathers between ranks.",
    ]
    return lines


def _ranked_lines(plan: Plan, ranked: list[Candidate], top: int) -> list[str]:
    lines: list[str] = []
    columns = [
        "#",
        "param/optim",
        "dtype",
        "host budget",
        "device budget",
        "buffers",
        "step s",
        "tokens/s",
        "read GB",
        "write GB",
        "peak dev",
        "peak host",
        "peak nvme",
        "disk",
        "peak RSS",
        "bound",
        "updates",
    ]
    rows = []
    fitting = [c for c in ranked if c.fits]
    for rank, c in enumerate(fitting[:top], 1):
        cfg, r = c.config, c.result
        rows.append(
            [
                str(rank),
                f"{cfg.offload_param}/{cfg.offload_optimizer}",
                cfg.precision.dtype,
                size_text(cfg.host_budget),
                size_text(cfg.device_budget),
                f"{cfg.buffer_count} x {size_text(cfg.buffer_size)}"
                if "nvme" in (cfg.offload_param, cfg.offload_optimizer)
                else "-",
                f"{r['step_seconds']:.3g}",
                f"{plan.tokens * plan.ranks / r['step_seconds']:,.0f}",
                _gb(r["bytes_read"]),
                _gb(r["bytes_written"]),
                size_text(r["peak_bytes"]["device"]),
                size_text(r["peak_bytes"]["host"]),
                size_text(r["peak_bytes"]["nvme"]),
                size_text(r.get("disk_bytes", 0)),
                size_text(r["rss_peak_bytes"]),
                c.bound,
                update_mode_text(r.get("update_mode")),
            ]
        )
    if rows:
        widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(columns)]
        lines.append("  ".join(col.ljust(w) for col, w in zip(columns, widths)).rstrip())
        for row in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    else:
        lines.append("no candidate fits")
    if len(fitting) > top:
        lines.append(f"... and {len(fitting) - top} more that fit (--top, --json)")
    misfits = [c for c in ranked if not c.fits]
    if misfits:
        lines += ["", f"{len(misfits)} candidate(s) do not fit:"]
        for c in misfits:
            cfg = c.config
            lines.append(
                f"  {cfg.offload_param}/{cfg.offload_optimizer} {cfg.precision.dtype} "
                f"host {size_text(cfg.host_budget)} device {size_text(cfg.device_budget)} "
                f"buffers {cfg.buffer_count} x {size_text(cfg.buffer_size)}: {c.reason}"
            )
    return lines
