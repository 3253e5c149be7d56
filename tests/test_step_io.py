"""The contended floor's helper: plain steps with a step's bytes moved beside them."""

from __future__ import annotations

from pathlib import Path

import torch

from swap import EngineSettings
from tools.common.step_io import CHUNK, StepIO, steps_beside_io


def test_each_step_moves_its_bytes_and_waits_for_them(tmp_path: Path) -> None:
    settings = EngineSettings(backend="threads", queue_depth=4)
    with StepIO(tmp_path, settings, read_bytes=3 * CHUNK, write_bytes=CHUNK + 1) as io:
        engine = io._engine
        before = engine.stats()
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        times, computes = steps_beside_io(model, optimizer, io, 3, 4, 64)
        after = engine.stats()
        assert after.bytes_read - before.bytes_read == 3 * 3 * CHUNK
        assert after.bytes_written - before.bytes_written == 3 * 2 * CHUNK  # whole transfers
        assert len(io.seconds) == 3 and all(s > 0 for s in io.seconds)
        # a step ends when both its compute and its bytes are done
        assert all(t >= c for t, c in zip(times, computes))
        assert all(t >= s for t, s in zip(times, io.seconds))
