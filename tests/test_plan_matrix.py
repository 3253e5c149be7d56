"""The validation matrix's judgement of one cell over interleaved passes
(tools/benchmarks/plan_matrix.py): medians of per-pass ratios, fits agreed in every pass."""

from __future__ import annotations

import pytest

from tools.benchmarks.plan_matrix import judge, main

GIB = 1 << 30


def prediction(step: float, read: float = 100e6, bound: str = "disk") -> dict:
    return {
        "fits": True,
        "step_seconds": step,
        "bytes_read": read,
        "bytes_written": 50e6,
        "rss_peak_bytes": GIB,
        "bound": bound,
    }


def measurement(step: float, read: float = 100e6) -> dict:
    return {"fits": True, "step_s": step, "read_bytes": read, "write_bytes": 50e6, "peak_rss": GIB}


def test_a_cell_is_the_median_of_its_passes_ratios():
    # the machine slowed in the second pass: the recording and the run together
    passes = [
        (prediction(1.0, bound="disk"), measurement(1.0)),
        (prediction(1.5, bound="compute"), measurement(1.2)),
        (prediction(1.1, read=110e6, bound="disk"), measurement(1.0)),
    ]
    judged = judge(passes)
    assert judged["agreed"]
    assert judged["ratios"]["step_s"] == pytest.approx(1.1)  # of 1.0, 1.25, 1.1
    assert judged["ratios"]["read_bytes"] == pytest.approx(1.0)
    assert judged["predicted"]["step_s"] == pytest.approx(1.1)
    assert judged["measured"]["step_s"] == pytest.approx(1.0)
    assert judged["step_spread"] == pytest.approx(1.2)
    assert judged["bound"] == "disk"


def test_a_cell_that_fits_in_one_pass_only_disagrees():
    refused = {"fits": False, "error": "BudgetError"}
    judged = judge(
        [(prediction(1.0), measurement(1.0)), (prediction(1.0), refused), (refused, refused)]
    )
    assert not judged["agreed"]
    assert judged["ratios"] == {}
    assert judged["predicted_fits"] == [True, True, False]
    assert judged["ran"] == [True, False, False]
    nowhere = judge([(refused, refused)] * 2)
    assert nowhere["agreed"] and nowhere["ratios"] == {}


def test_no_pass_is_refused():
    with pytest.raises(ValueError, match="at least one pass"):
        judge([])
    with pytest.raises(SystemExit, match="--passes must be at least 1"):
        main(["--passes", "0"])
