"""tools.benchmarks.quant_quality's evaluation on a briefly trained demo GPT: the weights stored
fp32 give the in-RAM logits exactly, quantized ones stay close to them and stream from disk."""

from __future__ import annotations

import torch

from infinity.cli.common.tiny_gpt import GPTConfig
from tools.benchmarks.quant_quality import Storage, evaluate, held_out_batches, train


def test_stored_weights_keep_the_trained_model_quality(tmp_path) -> None:
    gpt = GPTConfig(vocab_size=128, context=16, layers=2, width=64, heads=4)
    held_out = held_out_batches(gpt, count=2, batch=4)
    trained, training = train(gpt, steps=30, batch=8, lr=3e-3, held_out=held_out)
    assert training["trained_loss"] < training["untrained_loss"] - 0.5
    storages = [Storage("auto"), Storage("int8"), Storage("int4", 32)]
    rows = evaluate(trained, storages, held_out, tmp_path, 128 << 10, 128 << 10)

    ram, fp32, int8, int4 = (rows[n] for n in ("ram", "ours-auto", "ours-int8", "ours-int4/g32"))
    assert fp32["equal"] and fp32["loss"] == ram["loss"] and fp32["top1"] == 1.0
    assert fp32["bytes_read_per_forward"] > 0  # budgets below the weights: they stream
    for row in (int8, int4):
        assert not row["equal"]  # the weights really were rounded
        assert 0 < row["max_abs_diff"] < 1.0
    assert int8["top1"] > 0.95 and abs(int8["relative"]) < 0.01
    assert int4["top1"] > 0.8 and abs(int4["relative"]) < 0.05
    assert ram["stored_bytes"] > int8["stored_bytes"] > int4["stored_bytes"]
    assert torch.isfinite(torch.tensor([r["loss"] for r in rows.values()])).all()
