"""Soak test: attached training under random I/O faults, checked against plain training.

    python -m tools.benchmarks.soak --minutes 10 --fault-rate 0.01

Trains a small GPT (infinity/cli/common/tiny_gpt.py) with parameters and AdamW state on NVMe while a
FaultInjectingBackend gives each swap request, with probability ``--fault-rate``, one of the
faults ``eio``, ``short``, ``slow``, ``drop`` or ``hang`` (hangs end at a short
``request_timeout``). Next to it a plain in-memory copy trains on the same batches.

A step the store cannot complete (a fault that outlasted the retries, or a dropped write found
at the next read) is skipped on both sides: the plain copy only steps after the attached one
succeeded, so it still holds the last good state, and the attached model is rebuilt from it (a
new store, parameters and optimizer state copied from the plain side). Every ``--check-every``
steps, and at the end, every parameter is compared with the plain copy (tolerance 1e-5).

A step counts as a hang when it takes longer than ``--hang-factor`` x the median step plus what
the timeouts allow (each attempt of a transfer may wait ``request_timeout``); a watchdog thread
also dumps every stack and exits if a step runs past ``--hard-limit`` seconds.

Exit status: 0 when no parameter ever mismatched and no step hung, else 1.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from infinity import OffloadConfig, TieredStore
from infinity.cli.common.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
from infinity.core.completions import MAX_RETRIES
from swap import FaultInjectingBackend

MODEL = GPTConfig(vocab_size=64, context=16, layers=2, width=32, heads=4)
SHARD = 16 << 10  # the largest parameter (an MLP matrix) is one 16 KiB shard
KINDS = ("eio", "short", "slow", "drop", "hang")
TOLERANCE = 1e-5
LR = 1e-3


class Watchdog(threading.Thread):
    """Aborts the run (stacks dumped, exit 3) when a step never ends: a deadlock must not
    stall the soak forever. Softer hangs are judged against the median afterwards."""

    def __init__(self, hard_limit: float) -> None:
        super().__init__(name="soak-watchdog", daemon=True)
        self.hard_limit = hard_limit
        self.started: float | None = None

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            started = self.started
            if started is not None and time.monotonic() - started > self.hard_limit:
                print(
                    f"soak: a step has run for over {self.hard_limit:.0f} s: hung; stacks:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)  # the hung thread cannot be stopped; nor can a normal exit join it


class Attached:
    """The store side: a TieredStore over a fault-injecting backend, rebuilt after failures;
    its counters are summed over every store it used."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.store: TieredStore | None = None
        self.faults: FaultInjectingBackend | None = None
        self.totals: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.stores = 0

    def build(self, plain: TinyGPT, plain_opt: torch.optim.Optimizer) -> None:
        """A fresh store holding a copy of the plain model and its optimizer state."""
        self.close()
        model = copy.deepcopy(plain)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        optimizer.load_state_dict(plain_opt.state_dict())
        args = self.args

        def wrap(backend):
            self.faults = FaultInjectingBackend(backend, seed=args.seed + self.stores)
            self.faults.random_faults(args.fault_rate, KINDS, max_delay=args.max_delay)
            return self.faults

        config = OffloadConfig(
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=(Path(self.root),),
            buffer_size=SHARD,
            buffer_count=args.buffer_count,
            device_budget=64 << 10,
            prefetch_depth=2,
        )
        self.store = TieredStore(
            config,
            backend_wrapper=wrap,
            engine_overrides={"request_timeout": args.request_timeout, "close_timeout": 5.0},
        )
        self.model, self.optimizer = self.store.attach(model, optimizer)
        self.stores += 1

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        loss = self.model(tokens, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def clear_faults(self) -> None:
        if self.faults is not None:
            self.faults.clear()

    def values(self) -> dict[str, torch.Tensor]:
        store = self.store
        assert store is not None, "build() first"
        return {e.name: store.materialize(e) for e in store.registry.entries}

    def close(self) -> None:
        store, self.store = self.store, None
        if store is None:
            return
        stats = store.stats()
        engine = store.engine.stats() if store.engine is not None else None
        for key in (
            "io_errors",
            "io_retries",
            "io_recoveries",
            "io_failures",
            "io_timeouts",
            "integrity_errors",
        ):
            self.totals[key] += stats[key]
        if engine is not None:
            self.totals["transfers"] += engine.read_transfers + engine.write_transfers
            self.totals["requests"] += engine.read_requests + engine.write_requests
        if self.faults is not None:
            self.injected.update(self.faults.injected)
        try:
            store.close(restore_params=False)  # the plain copy is the state to go on from
        except Exception as exc:
            self.totals["close_errors"] += 1
            logging.getLogger("tools.benchmarks.soak").error("close failed: %s", exc)


def mismatches(attached: dict[str, torch.Tensor], plain: TinyGPT) -> list[str]:
    bad = []
    for name, param in plain.named_parameters():
        value = attached.get(name)
        if value is None or not torch.allclose(
            value, param.detach(), rtol=TOLERANCE, atol=TOLERANCE
        ):
            bad.append(name)
    return bad


def check(attached: Attached, plain: TinyGPT, bad: Counter, failures: Counter) -> bool:
    """Compares every parameter; False when one could not be read (a dropped write found:
    the caller rebuilds the attached side from the plain one, which is at the same step)."""
    try:
        values = attached.values()
    except Exception as exc:
        failures[type(exc).__name__] += 1
        return False
    for name in mismatches(values, plain):
        bad[name] += 1
    return True


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    plain = TinyGPT(MODEL)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, fused=True)
    batches = synthetic_batches(MODEL, 4, seed=args.seed)
    root = Path(args.nvme_path or tempfile.mkdtemp(prefix="infinity-soak-"))
    attached = Attached(args, root)
    attached.build(plain, plain_opt)
    watchdog = Watchdog(args.hard_limit)
    watchdog.start()
    durations: list[float] = []
    failures: Counter[str] = Counter()  # failed steps, by error
    failed_checks: Counter[str] = Counter()  # checks whose reads failed, by error
    bad: Counter[str] = Counter()
    checks = steps = 0
    deadline = time.monotonic() + args.minutes * 60
    try:
        while time.monotonic() < deadline:
            tokens, targets = next(batches)
            watchdog.started = started = time.monotonic()
            try:
                attached.step(tokens, targets)
                error = None
            except Exception as exc:
                error = exc
            finally:
                durations.append(time.monotonic() - started)
                watchdog.started = None
            if error is not None:
                failures[type(error).__name__] += 1
                attached.build(plain, plain_opt)  # back to the last good state
                continue
            plain(tokens, targets).backward()
            plain_opt.step()
            plain_opt.zero_grad()
            steps += 1
            if steps % args.check_every == 0:
                if check(attached, plain, bad, failed_checks):
                    checks += 1
                else:
                    attached.build(plain, plain_opt)
        # The final check, faults off (a write dropped earlier still fails it: then the
        # attached side is rebuilt and checked again).
        attached.clear_faults()
        if not check(attached, plain, bad, failed_checks):
            attached.build(plain, plain_opt)
            attached.clear_faults()
            check(attached, plain, bad, failed_checks)
        checks += 1
    finally:
        attached.close()
        if args.nvme_path is None:
            shutil.rmtree(root, ignore_errors=True)
    median = statistics.median(durations) if durations else 0.0
    allowance = 2 * (MAX_RETRIES + 1) * args.request_timeout
    threshold = args.hang_factor * median + allowance
    hangs = sum(d > threshold for d in durations)
    totals, injected = attached.totals, attached.injected
    ordered = sorted(durations)
    lines = [
        f"soak: {args.minutes:g} min, fault rate {args.fault_rate:g} per request, kinds "
        f"{', '.join(KINDS)}, request_timeout {args.request_timeout:g} s, seed {args.seed}",
        f"  steps attempted      {len(durations)} ({steps} succeeded, {sum(failures.values())} "
        f"failed and skipped on both sides; {attached.stores} store(s) built)",
        f"  operations           {totals['transfers']} transfers, {totals['requests']} requests",
        f"  faults injected      {sum(injected.values())}: "
        + (", ".join(f"{k} {injected[k]}" for k in KINDS) or "none"),
        f"  transfer errors      {totals['io_errors']} (timeouts {totals['io_timeouts']}, "
        f"integrity {totals['integrity_errors']})",
        f"  retries              {totals['io_retries']} issued, {totals['io_recoveries']} "
        f"recovered, {totals['io_failures']} gave up",
        f"  failed steps         {sum(failures.values())}"
        + (f" ({', '.join(f'{k} {v}' for k, v in failures.most_common())})" if failures else ""),
        f"  failed checks        {sum(failed_checks.values())}"
        + (
            f" ({', '.join(f'{k} {v}' for k, v in failed_checks.most_common())}: a parameter "
            f"could not be read back; rebuilt from the plain copy)"
            if failed_checks
            else ""
        ),
        f"  close errors         {totals['close_errors']}",
        f"  step time            median {median * 1e3:.1f} ms, p99 "
        f"{ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if ordered else 0:.1f} ms, max "
        f"{(ordered[-1] if ordered else 0) * 1e3:.1f} ms",
        f"  hangs                {hangs} (steps over {threshold:.2f} s = {args.hang_factor:g} x "
        f"median + {allowance:g} s of timeouts)",
        f"  data mismatches      {sum(bad.values())} in {checks} checks of every parameter "
        f"(tolerance {TOLERANCE:g})" + (f": {', '.join(sorted(bad))}" if bad else ""),
    ]
    ok = not bad and not hangs
    lines.append(f"  result               {'PASS' if ok else 'FAIL'}")
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to train")
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=0.01,
        help="probability that a swap request gets a fault",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=0.25,
        help="seconds before a hung request fails (engine request_timeout)",
    )
    parser.add_argument(
        "--max-delay", type=float, default=0.05, help="longest delay of a 'slow' fault, seconds"
    )
    parser.add_argument("--buffer-count", type=int, default=12, help="arena slots")
    parser.add_argument(
        "--check-every",
        type=int,
        default=10,
        help="compare every parameter with the plain copy every N steps",
    )
    parser.add_argument("--hang-factor", type=float, default=10.0)
    parser.add_argument(
        "--hard-limit",
        type=float,
        default=120.0,
        help="a step running this long aborts the soak (exit 3)",
    )
    parser.add_argument(
        "--nvme-path",
        default=None,
        help="swap directory (default: a temporary one, removed at the end)",
    )
    parser.add_argument(
        "--log", default=None, help="write the runtime's warnings (retries, faults) to this file"
    )
    args = parser.parse_args(argv)
    if args.log:
        logging.basicConfig(
            filename=args.log,
            level=logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    else:
        logging.basicConfig(level=logging.CRITICAL)  # the report is the output
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
