"""Elastic restart under torchrun: a rank SIGKILLed at a random step after the first checkpoint
(at a step that saves one, half-way through writing it); torchrun (--max-restarts 1) restarts
both ranks, which resume from the newest complete checkpoint (tests/elastic_run.py: the
README's recipe, asynchronous checkpoints every few steps, the data position and LR scheduler
in ``extra``); the job finishes with the parameters of an uninterrupted run bit for bit, and
nvme_path holds nothing but the live run's swap files (and nothing once it closed)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.waiting import GUARD

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
EVERY = 3  # a checkpoint at steps 3, 6 and 9
#: where the kill lands: seeded, and given in every assertion message. The default kills rank 0
#: (the checkpoints' coordinator) at step 9, half-way through writing that step's checkpoint;
#: INFINITY_ELASTIC_SEED picks another (36: rank 1 between forward and backward at step 7).
SEED = int(os.environ.get("INFINITY_ELASTIC_SEED", "4"))


def _torchrun(tmp: Path, name: str, *extra: str) -> tuple[Path, str]:
    """The job under torchrun (2 ranks, one restart allowed); its output folder and log."""
    out, nvme = tmp / name / "out", tmp / name / "nvme"
    nvme.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(REPO / "tests" / "elastic_run.py"),
        "--checkpoints",
        str(tmp / name / "checkpoints"),
        "--nvme",
        str(nvme),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        *extra,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LOGLEVEL": "WARNING",
        # The README's launch: a restart's process group on a store of its own (on the store
        # torchrun shares, the restarted ranks read the dead attempt's addresses)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    agent = subprocess.Popen(
        command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log, _ = agent.communicate(timeout=2 * GUARD)
    except subprocess.TimeoutExpired:
        # SIGTERM: the agent stops its workers (each in a session of its own) before it exits.
        agent.send_signal(signal.SIGTERM)
        log, _ = agent.communicate(timeout=GUARD)
        raise AssertionError(f"{name}: the job did not finish\n{log[-4000:]}") from None
    assert agent.returncode == 0, f"{name}: torchrun failed\n{log[-6000:]}"
    assert list(nvme.iterdir()) == [], f"{name}: swap files left after the job"
    return out, log


def _params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"params-{rank}.pt", weights_only=True)


def test_a_rank_killed_mid_training_restarts_and_ends_as_an_uninterrupted_run(tmp_path):
    pick = random.Random(SEED)
    kill_rank = pick.randrange(2)
    # After the first checkpoint is complete: the second save waits for the first.
    kill_step = pick.randrange(2 * EVERY + 1, STEPS)
    what = f"seed {SEED}: rank {kill_rank} killed at step {kill_step}"

    reference, _ = _torchrun(tmp_path, "uninterrupted")
    killed, log = _torchrun(
        tmp_path, "killed", "--kill-rank", str(kill_rank), "--kill-step", str(kill_step)
    )

    reports = [json.loads((killed / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["attempt"] for r in reports] == [1, 1], f"{what}: not restarted\n{log[-4000:]}"
    what += f" (the restart found {reports[0]['found']})"
    if kill_step % EVERY == 0:
        # Killed while writing its part of that step's checkpoint: left unfinished, passed over.
        found = reports[0]["found"]
        assert f"step-{kill_step}.partial" in found and f"step-{kill_step}" not in found, what
        last_started = kill_step - EVERY
    else:
        last_started = (kill_step - 1) // EVERY * EVERY
    # Resumed from the last save started before the kill, or the one before it when the kill
    # came while that one was still being written.
    resumed = {r["resumed_from"] for r in reports}
    assert len(resumed) == 1, f"{what}: the ranks resumed from {resumed}"
    assert resumed <= {f"step-{last_started}", f"step-{last_started - EVERY}"}, (
        f"{what}: resumed from {resumed}"
    )
    assert reports[0]["start"] == int(resumed.pop().removeprefix("step-")), what

    expected = _params(reference, 0)
    for rank in range(2):
        for run in (reference, killed):
            final = _params(run, rank)
            assert final.keys() == expected.keys()
            differ = {
                key: (value - expected[key]).abs().max().item()
                for key, value in final.items()
                if not torch.equal(value, expected[key])
            }
            assert not differ, f"{what}: {run.parent.name} rank {rank}: max differences {differ}"

    # While the restarted job ran, nvme_path held its two ranks' run directories only: the
    # killed rank's was reclaimed, the survivor's removed as it was stopped.
    live = sorted(reports[0]["own"] + reports[1]["own"])
    for report in reports:
        assert report["nvme_holds"] == live, f"{what}: {report['nvme_holds']} != {live}"
