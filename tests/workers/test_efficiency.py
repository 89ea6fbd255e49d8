"""`EfficiencyMeter`: MFU from the engine's counted work and the device's peak; an impossible MFU (above 100%)
on a CPU means the cached peak is too low, so it is measured again, once, loudly."""

from __future__ import annotations

import logging

import pytest

from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.engines.training.mesh import ParallelLayout
from hybridflow.models import load_tokenizer, save_tiny_model
from hybridflow.workers import efficiency
from tests.engines.helpers import make_batch


def test_an_impossible_mfu_measures_the_peak_again(tmp_path, monkeypatch, caplog):
    path = save_tiny_model(tmp_path / "tiny")
    engine = build_fsdp_engine(path, FSDPEngineConfig(micro_batch_size_per_gpu=4))
    monkeypatch.setattr(efficiency, "device_peak_flops", lambda device, threads: (1.0, "a stale figure"))
    remeasured = []

    def remeasure(threads, remeasure=False):
        remeasured.append(remeasure)
        return 1e18

    monkeypatch.setattr(efficiency, "cpu_peak_flops", remeasure)
    meter = efficiency.EfficiencyMeter(engine, ParallelLayout(1))
    batch = make_batch(len(load_tokenizer(path)), batch_size=4)
    engine.compute_log_prob(batch)
    with caplog.at_level(logging.WARNING, logger=efficiency.__name__):
        first = meter.metrics("actor_infer", seconds=1.0)
    assert remeasured == [True] and "measured again" in caplog.text
    assert 0 < first["perf/mfu/actor_infer"] < 1e-6  # against the new peak
    engine.compute_log_prob(batch)
    meter.metrics("actor_infer", seconds=1.0)
    assert remeasured == [True]  # once per meter
    assert meter.peak_flops == pytest.approx(1e18)
