"""benchmarks/gpu_smoke.py's CPU-reachable parts: the settings it runs and the table's averages."""

from __future__ import annotations

import pytest

from benchmarks.gpu_smoke import COLUMNS, settings, summarize
from hybridflow.trainer.config import load_config


def test_every_setting_is_a_valid_demo_command_line():
    runs = settings(num_gpus=2)
    assert "hf, 2 GPUs" in runs and "hf, 1 GPU" in runs and "native, 1 GPU" in runs
    assert "hf, 2 GPUs" not in settings(num_gpus=1)
    for overrides in runs.values():
        config = load_config(["trainer.device=cpu", *overrides], config_name="grpo_smollm2_demo")
        assert config.trainer.n_gpus_per_node in (1, 2)


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
