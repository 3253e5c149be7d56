"""infinity-plan (infinity/cli/plan.py) on tiny models, and the planner's extrapolation from a
scaled-down copy (infinity.planning.scaled.recording_for_scaled)."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.cli import plan, plan_args  # noqa: E402
from infinity.config import format_size  # noqa: E402
from infinity.planning import planner  # noqa: E402
from infinity.planning import scaled as planner_scaled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DISK = ["--disk-gbps", "1.5,1"]
#: a 2-layer TinyGPT from its module path, small enough to record in a few seconds
TINY_GPT = [
    "--module",
    "infinity.cli.common.tiny_gpt:TinyGPT",
    "--args",
    '{"layers": 2, "width": 32, "vocab_size": 64}',
    "--batch",
    "2",
    "--seq-len",
    "16",
]
#: one candidate: everything on NVMe, a host budget far below the state, so every step streams
STREAMING = [
    "--offload-param",
    "nvme",
    "--offload-optimizer",
    "nvme",
    "--host-budget",
    "256KiB",
    "--device-budget",
    "256KiB",
    "--buffer-size",
    "32KiB",
    "--steps",
    "2",
]


def _llama_config(layers: int = 2, **changes) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        **{
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            **changes,
        }
    )


def _config_dir(tmp_path: Path, name: str, layers: int = 2, **changes) -> Path:
    path = tmp_path / name
    _llama_config(layers, **changes).save_pretrained(path)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_and_written_config_load(tmp_path, capsys):
    config_dir = _config_dir(tmp_path, "llama")
    best, report = tmp_path / "best.json", tmp_path / "plan.json"
    code, out, err = _run(
        capsys,
        "--hf-config",
        str(config_dir),
        "--batch",
        "2",
        "--seq-len",
        "16",
        *DISK,
        "--steps",
        "2",
        "--write-config",
        str(best),
        "--json",
        str(report),
    )
    assert code == 0, err
    assert "the model itself" in out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    for column in (
        "param/optim",
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
    ):
        assert column in header
    rows = [line for line in out.splitlines() if re.match(r"^\d+\s", line)]
    assert rows
    candidates = json.loads(report.read_text())["tables"][0]["candidates"]
    fitting = [c for c in candidates if c["fits"]]
    times = [c["step_seconds"] for c in fitting]
    assert times == sorted(times) and times[0] > 0  # best first
    assert all(c["bound"] in ("compute", "CPU optimizer", "memcpy", "disk") for c in fitting)
    # where step_in_backward='auto' would run the updates, in the table's last column
    words = {"in backward": "backward", "in optimizer.step()": "step"}
    assert [row.split()[-1] for row in rows] == [words[c["update_mode"]] for c in fitting][
        : len(rows)
    ]
    # The written file is what the runtime loads, as it is, and is the best candidate.
    loaded = infinity.OffloadConfig.from_file(best)
    assert loaded.to_dict() == fitting[0]["config"]
    # ... and a store runs with it.
    model = transformers.LlamaForCausalLM(_llama_config())
    with infinity.TieredStore(loaded.replace(nvme_path=(tmp_path,))) as store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
        tokens = torch.randint(0, 256, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        # the disk the plan said the candidate needs is what the store's preflight counts
        assert store.stats()["disk"]["preflight_bytes"] == fitting[0]["disk_bytes"]
    on_nvme = [c for c in fitting if "nvme" in c["config"]["offload_param"]]
    assert on_nvme and all(c["disk_bytes"] > 0 for c in on_nvme)


def test_module_path_and_this_machine(tmp_path, capsys):
    code, out, err = _run(capsys, *TINY_GPT, *DISK, *STREAMING)
    assert code == 0, err
    assert "infinity.cli.common.tiny_gpt:TinyGPT" in out and "nvme/nvme" in out
    assert "contention not measured: compute and the disk" in out


def test_contention_measured_here_or_given(tmp_path, capsys):
    """--contention measure times the model's plain step alone and beside the engine on the
    swap directory; given figures are replayed as they are. Either reaches every prediction."""
    common = [
        *TINY_GPT,
        *DISK,
        *STREAMING,
        "--nvme-path",
        str(tmp_path),
    ]
    plans = {}
    for given in ("measure", "1.5,0.5"):
        report = tmp_path / f"{given}.json"
        code, out, err = _run(capsys, *common, "--contention", given, "--json", str(report))
        assert code == 0, err
        plans[given] = json.loads(report.read_text())
        assert "beside the disk" in out
    measured = plans["measure"]["contention"]
    assert measured["source"].startswith("measured here: the model's plain step took")
    assert measured["compute_slowdown"] >= 1.0
    # the tiny model's step is milliseconds: timed in a row for long enough to see transfers
    # finish beside it, or the disk would seem to stop
    assert 0.05 < measured["io_retained"] <= 1.0
    given = plans["1.5,0.5"]
    assert given["contention"] == {
        "compute_slowdown": 1.5,
        "io_retained": 0.5,
        "source": "--contention",
    }
    fitting = [c for c in given["tables"][0]["candidates"] if c["fits"]]
    assert fitting and all(c["contention"]["source"] == "--contention" for c in fitting)


def test_disk_given_with_its_combined_rate(tmp_path, capsys):
    assert plan_args.gbps_pair("3") == (3.0, 3.0, None)
    assert plan_args.gbps_pair("3,2") == (3.0, 2.0, None)
    assert plan_args.gbps_pair("3,2,1.5") == (3.0, 2.0, 1.5)
    for bad in ("1,2,3,4", "1,0", "fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="READ,WRITE"):
            plan_args.gbps_pair(bad)
    report = tmp_path / "plan.json"
    code, out, err = _run(
        capsys,
        *TINY_GPT,
        "--disk-gbps",
        "1.5,1,0.6",
        *STREAMING,
        "--nvme-path",
        str(tmp_path),
        "--json",
        str(report),
    )
    assert code == 0, err
    assert "0.6 GB/s both at once" in out
    table = json.loads(report.read_text())["tables"][0]
    assert table["disk"]["combined_gbps"] == 0.6
    assert any(c["fits"] for c in table["candidates"])


def test_disk_measured_here_in_each_candidate_s_requests(tmp_path, capsys):
    report = tmp_path / "plan.json"
    code, out, err = _run(
        capsys,
        *TINY_GPT,
        "--disk",
        "measure",
        "--offload-optimizer",
        "nvme,cpu",
        "--buffer-size",
        "64KiB,128KiB",
        "--nvme-path",
        str(tmp_path),
        "--json",
        str(report),
    )
    assert code == 0, err
    assert "measured here per candidate" in out
    candidates = json.loads(report.read_text())["tables"][0]["candidates"]
    on_nvme = [
        c
        for c in candidates
        if "nvme" in (c["config"]["offload_param"], c["config"]["offload_optimizer"])
    ]
    assert on_nvme and len(on_nvme) < len(candidates)
    shapes = set()
    for c in on_nvme:
        disk, config = c["disk"], c["config"]
        assert disk["read_gbps"] > 0 and disk["write_gbps"] > 0 and disk["combined_gbps"] > 0
        assert disk["source"] == (
            f"measured here, {format_size(config['buffer_size'])} requests x "
            f"{config['buffer_count']} in flight"
        )
        shapes.add((config["buffer_size"], config["buffer_count"]))
    assert len(shapes) > 1  # each shape measured on its own
    # nothing on NVMe, nothing measured
    assert all("disk" not in c for c in candidates if c not in on_nvme)


def _plan_json(capsys, tmp_path: Path, config_dir: Path, name: str) -> dict:
    report = tmp_path / f"{name}.json"
    code, out, err = _run(
        capsys,
        "--hf-config",
        str(config_dir),
        "--batch",
        "2",
        "--seq-len",
        "16",
        *DISK,
        *STREAMING,
        "--max-local-params",
        "20000",
        "--json",
        str(report),
    )
    assert code == 0, err
    assert "scaled-down copy" in out
    return json.loads(report.read_text())


def test_scaled_copy_bytes_follow_parameters(tmp_path, capsys):
    wide = {"hidden_size": 64, "intermediate_size": 128}  # 2.9 and 7.6 MB of state
    small = _plan_json(capsys, tmp_path, _config_dir(tmp_path, "l4", 4, **wide), "l4")
    large = _plan_json(capsys, tmp_path, _config_dir(tmp_path, "l12", 12, **wide), "l12")
    assert small["scaled"] and large["scaled"]
    a = small["tables"][0]["candidates"][0]
    b = large["tables"][0]["candidates"][0]
    assert a["fits"] and b["fits"], (a.get("reason"), b.get("reason"))
    ratio = large["parameters"] / small["parameters"]
    assert ratio > 2
    for key in ("bytes_read", "bytes_written"):
        assert b[key] / a[key] == pytest.approx(ratio, rel=0.2), key
    assert b["peak_bytes"]["nvme"] / a["peak_bytes"]["nvme"] == pytest.approx(ratio, rel=0.1)
    # Compute grows with the layers too: more events, each as the copy's layer took. Each
    # prediction is held against its own recording's compute (the two copies are alike): two
    # recordings' seconds compared with each other only say which ran on a busier machine.
    grown = b["resource_seconds"]["compute"] / large["recorded"]["compute_seconds"]
    base = a["resource_seconds"]["compute"] / small["recorded"]["compute_seconds"]
    assert large["recorded"]["parameters"] == small["recorded"]["parameters"]
    assert grown > base


def _recorded(model: torch.nn.Module, tmp_path: Path) -> planner.Recording:
    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(tmp_path,),
        host_budget=1 << 20,
        buffer_size=64 << 10,
        buffer_count=4,
    )
    with infinity.TieredStore(config) as store:
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
        tokens = torch.randint(0, 256, (2, 16))
        for _ in range(2):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert [name for name, _ in planner_scaled.module_table(model)] == list(
            store.placement.settings.module_names
        )
        return planner.recording_of(store)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_extrapolated_trace_is_the_full_models(tmp_path, tied):
    """The trace built from a 2-layer copy names the modules, entries and completed gradients
    that a store attached to the 5-layer model records, in its order."""
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(_llama_config(2, tie_word_embeddings=tied))
    full = transformers.LlamaForCausalLM(_llama_config(5, tie_word_embeddings=tied))
    extrapolated = planner_scaled.recording_for_scaled(small, _recorded(small, tmp_path), full)
    recorded = _recorded(full, tmp_path)
    assert extrapolated.trace.events == recorded.trace.events
    assert extrapolated.trace.last_backward == recorded.trace.last_backward
    if hasattr(recorded.trace, "grads"):
        assert extrapolated.trace.grads == recorded.trace.grads


def test_narrower_copy_scales_compute_by_flops(tmp_path):
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(_llama_config(2))
    full_config = _llama_config(
        3, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4
    )
    with torch.device("meta"):
        full = transformers.LlamaForCausalLM(full_config)
    recording = _recorded(small, tmp_path)
    extrapolated = planner_scaled.recording_for_scaled(small, recording, full)
    table = dict(planner_scaled.module_table(full))
    names = [name for name, _ in planner_scaled.module_table(full)]
    seconds = {
        names[e.module]: c
        for e, c in zip(extrapolated.trace.events, extrapolated.trace.compute)
        if e.kind == "fwd"
    }
    small_seconds = {
        name: c
        for (name, _), e, c in (
            (planner_scaled.module_table(small)[e.module], e, c)
            for e, c in zip(recording.trace.events, recording.trace.compute)
        )
        if e.kind == "fwd"
    }
    # A linear layer twice as wide both ways: 4x the FLOPs; layer 2 repeats the copy's layers.
    for layer in (0, 2):
        name = f"model.layers.{layer}.mlp.up_proj"
        assert name in table
        mean = (
            small_seconds["model.layers.0.mlp.up_proj"]
            + small_seconds["model.layers.1.mlp.up_proj"]
        ) / 2
        assert seconds[name] == pytest.approx(4 * mean)
    # An embedding's lookup grows with its width only.
    assert seconds["model.embed_tokens"] == pytest.approx(2 * small_seconds["model.embed_tokens"])


def test_skeleton_per_rank_holds_a_slice():
    model = transformers.LlamaForCausalLM(_llama_config(2))
    whole = planner_scaled.skeleton(model)
    rank = planner_scaled.skeleton(model, ranks=8)
    assert [n for n, _ in whole.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (_, p), (_, q) in zip(model.named_parameters(), rank.named_parameters()):
        assert q.is_meta and q.numel() == -(-p.numel() // 8)


def test_budget_below_one_module_does_not_fit(tmp_path, capsys):
    config_dir = _config_dir(tmp_path, "llama")
    code, out, err = _run(
        capsys,
        "--hf-config",
        str(config_dir),
        "--batch",
        "2",
        "--seq-len",
        "16",
        *DISK,
        "--offload-param",
        "nvme",
        "--offload-optimizer",
        "nvme",
        "--host-budget",
        "1MiB",
        "--device-budget",
        "4KiB",
        "--buffer-size",
        "64KiB",
        "--steps",
        "2",
    )
    assert code == 0, err
    assert "no candidate fits" in out and "do not fit" in out
    match = re.search(r"cannot hold module '([^']+)'", out)
    assert match, out
    model = transformers.LlamaForCausalLM(_llama_config())
    assert match.group(1) in dict(model.named_modules())
    # Nothing to write: said in one line, exit 2.
    code, out, err = _run(
        capsys,
        "--hf-config",
        str(config_dir),
        "--batch",
        "2",
        "--seq-len",
        "16",
        *DISK,
        "--offload-param",
        "nvme",
        "--offload-optimizer",
        "nvme",
        "--host-budget",
        "1MiB",
        "--device-budget",
        "4KiB",
        "--buffer-size",
        "64KiB",
        "--steps",
        "2",
        "--write-config",
        str(tmp_path / "best.json"),
    )
    assert code == 2 and "no candidate fits" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "best.json").exists()


@pytest.mark.parametrize(
    "case",
    [
        "missing config",
        "bad disk json",
        "missing disk json",
        "no disk",
        "bad module",
        "bad args",
        "bad contention",
        "two disks",
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    config_dir = _config_dir(tmp_path, "llama")
    bad_json = tmp_path / "bench.json"
    bad_json.write_text('{"results": []}')
    argv = {
        "missing config": ["--hf-config", str(tmp_path / "nope"), *DISK],
        "bad disk json": ["--hf-config", str(config_dir), "--disk", str(bad_json)],
        "missing disk json": ["--hf-config", str(config_dir), "--disk", str(tmp_path / "x")],
        "no disk": ["--hf-config", str(config_dir)],
        "bad module": ["--module", "infinity.cli.common.tiny_gpt:Nope", *DISK],
        "bad args": [
            "--module",
            "infinity.cli.common.tiny_gpt:TinyGPT",
            "--args",
            "{layers",
            *DISK,
        ],
        "bad contention": ["--hf-config", str(config_dir), *DISK, "--contention", "0.5,2"],
        "two disks": ["--hf-config", str(config_dir), *DISK, "--disk", "measure"],
    }[case]
    code, out, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infinity-plan: error:"), err
    expected = {
        "missing config": "does not exist",
        "bad disk json": "infinity-bench",
        "missing disk json": "does not exist",
        "no disk": "--disk-gbps",
        "bad module": "Nope",
        "bad args": "JSON",
        "bad contention": "SLOWDOWN,RETAINED",
        "two disks": "not both",
    }[case]
    assert expected in lines[0]


def test_extrapolated_trace_of_a_sequential_stack(tmp_path):
    """An nn.Sequential of Linear, ReLU, ... (tools.benchmarks.bench_overlap's MLP) repeats every
    other child; the extrapolated trace is the one the full stack records."""
    from tools.common.workloads import mlp

    def recorded(model: torch.nn.Module) -> planner.Recording:
        config = infinity.OffloadConfig(
            device="cpu",
            offload_param="nvme",
            offload_optimizer="nvme",
            nvme_path=(tmp_path,),
            host_budget=1 << 20,
            buffer_size=16 << 10,
            buffer_count=8,
        )
        with infinity.TieredStore(config) as store:
            model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))
            for _ in range(2):
                model(torch.randn(4, 32)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            return planner.recording_of(store)

    small = mlp(2, 32)
    extrapolated = planner_scaled.recording_for_scaled(small, recorded(small), mlp(5, 32))
    expected = recorded(mlp(5, 32))
    assert extrapolated.trace.events == expected.trace.events
    assert extrapolated.attach_peak_rss == 0  # the copy's says nothing of the full model's
    if hasattr(expected.trace, "grads"):
        assert extrapolated.trace.grads == expected.trace.grads


def test_validate_runs_the_best_candidate_and_compares(tmp_path, capsys):
    report = tmp_path / "plan.json"
    code, out, err = _run(
        capsys, *TINY_GPT, *DISK, *STREAMING, "--validate", "3", "--json", str(report)
    )
    assert code == 0, err
    block = out[out.index("validation:") :].splitlines()
    assert [line.split()[0] for line in block[2:7]] == [
        "step",
        "read/step",
        "write/step",
        "peak",
        "updates",
    ]
    assert block[-1].startswith("verdict: ")
    data = json.loads(report.read_text())
    validation = data["validation"]
    best = next(c for c in data["tables"][0]["candidates"] if c["fits"])
    # The candidate's configuration, on the directory the recording swapped to.
    assert {**validation["config"], "nvme_path": []} == {**best["config"], "nvme_path": []}
    (swap_dir,) = validation["config"]["nvme_path"]
    assert Path(swap_dir).name.startswith("infinity-plan-") and not Path(swap_dir).exists()
    measured = validation["measured"]
    assert (validation["warmup"], measured["warmup"], measured["steps"]) == (
        planner.WARMUP,
        planner.WARMUP,
        3,
    )
    assert len(measured["steps_s"]) == 3
    # Bytes per step are the store's counters over the measured steps; the step streams.
    for key, counter in (("read_bytes", "bytes_read"), ("write_bytes", "bytes_written")):
        span = measured["counters"][counter]
        assert span["after"] > span["before"]
        assert measured[key] == (span["after"] - span["before"]) / 3
    for key, compared in validation["compared"].items():
        assert compared["measured"] == measured[key]
        assert math.isfinite(compared["ratio"]) and compared["ratio"] > 0, key
        assert compared["ratio"] == pytest.approx(compared["predicted"] / compared["measured"])
        ratio_text = f"{compared['ratio']:.2f}" if key == "step_s" else f"{compared['ratio']:.3f}"
        assert any(line.rstrip().endswith(ratio_text) for line in block), (key, block)
    assert validation["predicted"]["step_seconds"] == validation["compared"]["step_s"]["predicted"]
    low, high = validation["predicted"]["step_seconds_spread"]
    assert f"({low:.4g}-{high:.4g})" in block[2]
    assert block[-1] == f"verdict: {validation['verdict']}"
    # the run's update mode is the one predicted, and the verdict says so
    modes = validation["update_mode"]
    assert modes["measured"] == measured["update_mode"] in ("in backward", "in optimizer.step()")
    assert modes["predicted"] == validation["predicted"]["update_mode"] == modes["measured"]
    assert block[6].split()[-1] == "same"
    assert block[-1].endswith(f"updates {modes['measured']}, as predicted")


def test_measured_steps_leave_the_warm_up_out(tmp_path):
    """measure_steps' bytes per step are the store's counters over the timed steps only."""
    from infinity.cli.common.measure import measure_steps
    from tools.common.workloads import mlp

    config = infinity.OffloadConfig(
        device="cpu",
        offload_param="nvme",
        offload_optimizer="nvme",
        nvme_path=(tmp_path,),
        host_budget=1 << 20,
        buffer_size=16 << 10,
        buffer_count=8,
    )
    after_each: list[dict] = []
    with infinity.TieredStore(config) as store:
        model = mlp(4, 128)  # 1 MiB of training state through a 128 KiB arena
        model, optimizer = store.attach(model, torch.optim.AdamW(model.parameters()))

        def step() -> None:
            model(torch.randn(4, 128)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            after_each.append(store.stats())

        measured = measure_steps(store, step, warmup=2, steps=3)
    assert len(after_each) == 5 and measured["steps"] == 3
    for key, counter in (("read_bytes", "bytes_read"), ("write_bytes", "bytes_written")):
        moved = after_each[4][counter] - after_each[1][counter]
        assert moved > 0
        assert measured[key] == moved / 3
    assert measured["step_s"] == sorted(measured["steps_s"])[1]


@pytest.mark.parametrize(
    "case", ["ranks", "device profile", "scaled", "max local params", "drives", "host ram"]
)
def test_validate_refuses_what_cannot_run_here(capsys, case):
    argv, expected = {
        "ranks": (["--ranks", "2"], "--ranks 2"),
        "device profile": (["--device-profile", "H100"], "--device-profile H100"),
        "scaled": (["--scaled"], "scaled-down copy (--scaled)"),
        "max local params": (["--max-local-params", "1000"], "> --max-local-params 1,000"),
        "drives": (["--drives", "2,4"], "no table of --drives 2,4 is for 1 drive"),
        "host ram": (
            ["--host-ram", "1024TiB"],
            "--host-ram 1024.0 TiB is more than this machine's",
        ),
    }[case]
    code, out, err = _run(capsys, *TINY_GPT, *DISK, *STREAMING, *argv, "--validate")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infinity-plan: error: --validate "), err
    assert expected in lines[0]
    assert "validation:" not in out and "recorded" not in out  # refused before any step


def test_verdict_names_what_missed():
    from infinity.cli.common.measure import compare
    from infinity.cli.plan_validation import verdict

    prediction = {"step_seconds": 1.0, "bytes_read": 100, "bytes_written": 0, "rss_peak_bytes": 90}
    measured = {"step_s": 1.1, "read_bytes": 100, "write_bytes": 0, "peak_rss": 100}
    backward = {"predicted": "in backward", "measured": "in backward"}
    assert verdict(compare(prediction, measured), backward) == (
        "within 15% / 5% / 10% (step time / bytes read and written / peak RSS); "
        "updates in backward, as predicted"
    )
    slow = {**measured, "step_s": 2.0}
    differ = {"predicted": "in backward", "measured": "in optimizer.step()"}
    assert verdict(compare(prediction, slow), differ) == (
        "missed: step time 0.50x (goal 15%), update mode (predicted in backward, ran in "
        "optimizer.step())"
    )
