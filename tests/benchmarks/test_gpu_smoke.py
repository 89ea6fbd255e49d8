"""benchmarks/gpu_smoke.py's CPU-reachable parts: the settings it runs and the table's averages."""

from __future__ import annotations

import pytest

from benchmarks.gpu_smoke import COLUMNS, settings, summarize
from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.validate import validate_config
from tests.helpers import write_rows


def test_every_setting_is_a_valid_demo_command_line(tmp_path):
    rows = write_rows(tmp_path / "train.parquet", ["reasoning_gym/basic_arithmetic"] * 16)
    data = [f"data.train_files=[{rows}]", f"data.val_files=[{rows}]"]
    runs = settings(num_gpus=2)
    assert "hf, 2 GPUs" in runs and "hf, 1 GPU" in runs and "native, 1 GPU" in runs
    assert "hf, 2 GPUs" not in settings(num_gpus=1)
    for overrides in runs.values():
        config = load_config(["trainer.device=cpu", *overrides], config_name="grpo_smollm2_demo")
        assert config.trainer.n_gpus_per_node in (1, 2)
        # every setting is one the trainer accepts, before a GPU minute is spent on it
        validate_config(load_config(["trainer.device=cpu", *overrides, *data], config_name="grpo_smollm2_demo"))


def test_summary_skips_the_warm_up_step_and_computes_tokens_per_second():
    records = {
        1: {key: 100.0 for _, key in COLUMNS} | {"perf/total_num_tokens": 1000.0, "timing_s/step": 100.0},
        2: {key: 2.0 for _, key in COLUMNS} | {"perf/total_num_tokens": 1000.0, "timing_s/step": 10.0},
        3: {key: 4.0 for _, key in COLUMNS} | {"perf/total_num_tokens": 3000.0, "timing_s/step": 10.0},
    }
    summary = summarize(records)
    assert summary["timing_s/step"] == pytest.approx(10.0)
    assert summary["perf/throughput_step"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert summary["perf/mfu/actor"] == pytest.approx(3.0)


def test_random_init_copy_keeps_the_architecture_and_tokenizer(tmp_path):
    """The offline node's stand-in: the config's architecture with new (seeded) weights, and the same tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.gpu_smoke import random_init_copy
    from hybridflow.models import load_tokenizer, save_tiny_model

    source = save_tiny_model(tmp_path / "source", num_layers=2, hidden=64, seed=1)  # random_init_copy draws seed 0
    copy = random_init_copy(source, tmp_path / "copy")
    assert AutoConfig.from_pretrained(copy).to_dict()["num_hidden_layers"] == 2
    assert len(load_tokenizer(copy)) == len(load_tokenizer(source))
    a = AutoModelForCausalLM.from_pretrained(source).model.layers[0].mlp.up_proj.weight
    b = AutoModelForCausalLM.from_pretrained(copy).model.layers[0].mlp.up_proj.weight
    assert b.dtype == torch.bfloat16 and a.shape == b.shape and not torch.equal(a.to(b.dtype), b)


def test_saved_metrics_are_named_after_the_setting(tmp_path):
    from benchmarks.gpu_smoke import save_metrics

    source = tmp_path / "metrics.jsonl"
    source.write_text('{"step": 1}\n')
    save_metrics(source, tmp_path / "out", "hf + LoRA r=16, 1 GPU")
    assert (tmp_path / "out" / "hf___LoRA_r_16__1_GPU.jsonl").read_text() == '{"step": 1}\n'
