"""infinity-generate (infinity/cli/generate.py) on tiny Hugging Face models, and bench_infer's
CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from infinity.cli import generate  # noqa: E402
from infinity.inference.quantized import WeightQuantization  # noqa: E402
from tools.benchmarks import bench_infer, infer_report  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 6
#: budgets well below the tiny models' ~0.1-0.4 MB, so every forward reads from the swap files
BUDGETS = ["--host-budget", "128KiB", "--buffer-size", "16KiB", "--device-budget", "96KiB"]


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    )


def _gpt2() -> torch.nn.Module:
    # A wide initialisation, so greedy decoding does not just repeat the last token. The
    # embeddings are tied (GPT-2's lm_head is wte): the checkpoint holds one copy.
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=96,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=0.5,
            bos_token_id=1,
            eos_token_id=2,
        )
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    models = {}
    for name, build in (("llama", _llama), ("gpt2", _gpt2)):
        torch.manual_seed(0)
        model = build().eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        models[name] = (model, path)
    return models


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = generate.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "rows", [[[5, 6, 7, 8]], [[5, 6, 7, 8], [9, 10, 11, 12]]], ids=["batch1", "batch2"]
)
def test_greedy_ids_equal_plain_generate(tmp_path, capsys, saved, name, rows):
    model, path = saved[name]
    ids = torch.tensor(rows)
    pad = generate.pad_token_id(model.generation_config)
    with torch.no_grad():
        expected = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=pad,
        )
    argv = [
        "--model",
        str(path),
        "--nvme-path",
        str(tmp_path),
        "--device",
        "cpu",
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--disk-gbps",
        "1",
        "--json",
        *BUDGETS,
    ]
    for row in rows:
        argv += ["--token-ids", ",".join(map(str, row))]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["sequences"] == expected.tolist()
    assert summary["new_token_ids"] == expected[:, 4:].tolist()
    assert summary["batch"] == len(rows) and summary["new_tokens"] == NEW_TOKENS
    assert summary["forwards"] == NEW_TOKENS
    assert summary["bytes_read"] > 0  # the weights really came from the swap files
    assert summary["tokens_per_second"] > 0 and 0 <= summary["stall_share"] <= 1
    assert list(tmp_path.iterdir()) == []  # the store removed its swap files


def test_bf16_compute_equals_the_plain_model_in_bf16(tmp_path, capsys, saved):
    model, path = saved["llama"]
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = transformers.LlamaForCausalLM(model.config).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = plain.to(torch.bfloat16).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    code, out, err = _run(
        capsys,
        "--model",
        str(path),
        "--nvme-path",
        str(tmp_path),
        "--token-ids",
        "5,6,7,8",
        "--dtype",
        "bf16",
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--disk-gbps",
        "1",
        "--json",
        *BUDGETS,
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["dtype"] == "bfloat16"
    assert summary["weight_bytes"] == 2 * sum(p.numel() for p in model.parameters())
    assert summary["sequences"] == expected.tolist()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_generate_what_their_decoded_values_do(tmp_path, capsys, saved, weights):
    """--weights int8|int4: the ids of the model whose weights are the decoded ones, in RAM,
    and the weights on NVMe in their stored bytes."""
    model, path = saved["llama"]
    plain = transformers.LlamaForCausalLM(model.config).eval()
    plain.load_state_dict(model.state_dict())
    quantization = WeightQuantization(weights, 32)
    stored = 0
    with torch.no_grad():
        for name, param in plain.named_parameters():
            quant = quantization.quantizer_for(name, param)
            if quant is None:
                stored += param.numel() * param.element_size()
            else:
                stored += quant.stored_bytes(param.numel())
                param.copy_(quant.round_trip(param))
        ids = torch.tensor([[5, 6, 7, 8]])
        expected = plain.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    argv = ["--model", str(path), "--nvme-path", str(tmp_path), "--token-ids", "5,6,7,8"]
    argv += ["--weights", weights, "--group-size", "32", "--max-new-tokens", str(NEW_TOKENS)]
    code, out, err = _run(capsys, *argv, "--disk-gbps", "1", "--json", *BUDGETS)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["sequences"] == expected.tolist()
    assert summary["weights"] == weights
    assert summary["weight_bytes"] == summary["weight_storage"]["stored_bytes"] == stored
    # bytes per parameter: int8 one and a scale a row; int4 half and 8 bytes a group of 32
    assert stored < sum(p.numel() for p in model.parameters()) * (1.1 if weights == "int8" else 0.8)
    code, out, err = _run(capsys, *argv, "--disk-gbps", "1", *BUDGETS)
    assert code == 0, err
    assert f"weights {weights} " in out and "quantized" in out


def test_a_group_size_that_does_not_divide_the_rows_is_one_line(tmp_path, capsys, saved):
    _, path = saved["llama"]
    code, _, err = _run(
        capsys,
        *("--model", str(path), "--nvme-path", str(tmp_path), "--token-ids", "1,2"),
        *("--weights", "int4", "--group-size", "48", "--disk-gbps", "1", *BUDGETS),
    )
    assert code == 2 and "quant_group_size" in err and "Traceback" not in err


def test_sampling_is_seeded(tmp_path, capsys, saved):
    _, path = saved["llama"]
    argv = [
        "--model",
        str(path),
        "--nvme-path",
        str(tmp_path),
        "--token-ids",
        "5,6,7,8",
        "--sample",
        "--temperature",
        "2",
        "--max-new-tokens",
        "8",
        "--disk-gbps",
        "1",
        "--json",
    ]
    runs = []
    for seed in ("1", "1", "2"):
        code, out, err = _run(capsys, *argv, "--seed", seed)
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["sampling"] == "sample"
    assert runs[0]["sequences"] == runs[1]["sequences"] != runs[2]["sequences"]


def test_batch_size_repeats_the_prompt_and_prints_a_summary(tmp_path, capsys, saved):
    _, path = saved["llama"]
    code, out, err = _run(
        capsys,
        "--model",
        str(path),
        "--nvme-path",
        str(tmp_path),
        "--token-ids",
        "5,6,7",
        "--batch-size",
        "3",
        "--max-new-tokens",
        "4",
        "--disk-gbps",
        "2.5",
        "--ignore-eos",
        *BUDGETS,
    )
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("[")]
    assert len(rows) == 3 and len(set(row[4:] for row in rows)) == 1
    for label in ("tokens/s", "prefill", "decode", "bytes read", "disk reads 2.50 GB/s", "stalls"):
        assert label in out


def test_prompt_with_a_tokenizer(tmp_path, capsys, saved):
    tokenizers = pytest.importorskip("tokenizers")
    model, path = saved["llama"]
    words = ["<pad>", "<s>", "</s>", "[UNK]", "hello", "world", "again"]
    vocab = {word: i for i, word in enumerate(words)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="<pad>", eos_token="</s>"
    )
    with_tokenizer = tmp_path / "with-tokenizer"
    model.save_pretrained(with_tokenizer)
    tokenizer.save_pretrained(with_tokenizer)
    code, out, err = _run(
        capsys,
        "--model",
        str(with_tokenizer),
        "--nvme-path",
        str(tmp_path),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "3",
        "--disk-gbps",
        "1",
        "--json",
    )
    assert code == 0, err
    summary = json.loads(out)
    assert summary["sequences"][0][:2] == [4, 5]
    assert summary["texts"][0].startswith("hello world")


@pytest.mark.parametrize(
    "case, fix",
    [
        ("missing", "does not exist"),
        ("empty", "config.json"),
        ("no-weights", "safetensors"),
    ],
)
def test_bad_model_directory_is_one_line(tmp_path, capsys, case, fix):
    path = tmp_path / case
    if case != "missing":
        path.mkdir()
    if case == "no-weights":
        (path / "config.json").write_text(json.dumps(_llama().config.to_dict()))
    code, out, err = _run(capsys, "--model", str(path), "--token-ids", "1,2")
    assert code == 2
    assert fix in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_prompt_without_tokenizer_names_token_ids(tmp_path, capsys, saved):
    _, path = saved["llama"]
    code, _, err = _run(
        capsys, "--model", str(path), "--nvme-path", str(tmp_path), "--prompt", "hello"
    )
    assert code == 2 and "--token-ids" in err and "tokenizer" in err


@pytest.mark.parametrize(
    "argv, fix",
    [
        (["--nvme-path", "/nonexistent/swap"], "mkdir -p"),
        (["--token-ids", "1,x"], "comma-separated integers"),
        (["--token-ids", "1,999"], "outside the vocabulary"),
    ],
)
def test_bad_flags_are_one_line(capsys, saved, argv, fix):
    _, path = saved["llama"]
    code, _, err = _run(
        capsys, "--model", str(path), "--token-ids", "1,2", "--disk-gbps", "1", *argv
    )
    assert code == 2 and fix in err and "Traceback" not in err


def test_bench_infer_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_infer.main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_bench_infer_holds_each_format_against_its_overlap_floor():
    forward = {
        "seconds": 0.5,
        "cache_drop": "drop_caches",
        "bytes_read": 1e9,
        "stall_seconds": 0.0,
        "read_seconds": 0.3,
        "equal": True,
        "allclose": True,
        "max_abs_diff": 0.0,
        "top1_agreement": 1.0,
    }
    systems = ("ram", "accelerate", "ours", "ours-int8")
    results = {
        "weight_bytes": 1e9,
        "stored_bytes": {"ours": 1e9, "ours-int8": 0.25e9},
        "forwards": {s: [dict(forward)] for s in systems},
        "disk_read_bps": [2e9],
        "load": (0.5, 0.5),
        "generate": {},
        # the in-RAM forward 0.4 s alone, 0.8 s beside the reads; reads keep all of 2 GB/s
        "contention": {
            "compute_alone_s": 0.4,
            "compute_beside_io_s": 0.8,
            "io_alone_bps": 2e9,
            "io_beside_compute_bps": 2e9,
            "compute_slowdown": 2.0,
            "io_retained": 1.0,
        },
    }
    results["forwards"]["ram"][0]["seconds"] = 0.4
    text = "\n".join(infer_report.summarize(results))
    # fp32: 1 GB read by 0.5 s, when the forward has done 0.25 of its 0.4 s; 0.15 s alone after
    assert results["summary"]["overlap_floor"] == pytest.approx(0.65)
    assert "overlap floor    0.650 s, ours 0.769x it" in text
    # int8: 0.25 GB read by 0.125 s (0.0625 s of compute done), then 0.3375 s alone
    int8 = results["summary"]["quantized"]["ours-int8"]
    assert int8["overlap_floor"] == pytest.approx(0.4625)
    assert "overlap floor  0.463 s, ours 1.081x it (before decoding)" in text
    assert "both floors    not measured" in text and "decoding here  not measured" in text
    # both: the forward and the decoding (0.4 + 0.1 s) beside the int8 reads: 0.25 GB read by
    # 0.125 s (0.0625 s of the 0.5 s done), then 0.4375 s alone
    results["decode_seconds"] = {"int8": 0.1}
    results["forwards"]["ours-int8"][0]["device_copy_seconds"] = 0.12
    text = "\n".join(infer_report.summarize(results))
    int8 = results["summary"]["quantized"]["ours-int8"]
    assert int8["both_floors"] == pytest.approx(0.5625)
    assert int8["device_copy_seconds"] == pytest.approx(0.12)
    assert "both floors    0.562 s = the two above at once" in text
    assert "(1.41x the floor, goal 1.2x); ours 0.889x it" in text
    assert "decoding here  0.120 s per forward (median)" in text
    del results["contention"]
    results["decode_seconds"] = {"int8": 0.1}
    text = "\n".join(infer_report.summarize(results))
    # the in-RAM forward and the decoding take the same cores: 0.4 + 0.1 s
    assert results["summary"]["quantized"]["ours-int8"]["cpu_floor"] == pytest.approx(0.5)
    assert "CPU floor      0.500 s = in RAM 0.400 s + decoding every stored weight once" in text
    assert "(1.25x the floor); ours 1.000x it" in text
    assert "overlap floor    not measured" in "\n".join(infer_report.summarize(results))
