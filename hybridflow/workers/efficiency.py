"""A worker's efficiency metrics per stage: `perf/mfu/{stage}` and `perf/max_memory_allocated_gb` (verl's keys).

MFU is the model FLOPs of what the engine computed in the stage (`FSDPEngine.pop_work`, `hybridflow.utils.flops`)
over the stage's seconds and the device's peak (`hybridflow.utils.peak_flops`: a table for GPUs, the measured fp32
matmul rate on CPUs). Each rank reports its own share: the FLOPs of its data shard, divided among the tensor- and
sequence-parallel peers that share it, over its own time and its own device's peak. The driver averages ranks,
which gives the group's MFU when the ranks take about the same time. The memory is the process's peak so far.
"""

from __future__ import annotations

import logging

import torch

from hybridflow.engines.training import FSDPEngine
from hybridflow.engines.training.mesh import ParallelLayout
from hybridflow.utils.device import peak_memory_gb
from hybridflow.utils.flops import compute_mfu, compute_model_flops, model_flops_shape
from hybridflow.utils.peak_flops import cpu_peak_flops, device_peak_flops

logger = logging.getLogger(__name__)

__all__ = ["EfficiencyMeter"]


class EfficiencyMeter:
    """MFU and peak memory of one engine's stages on this rank."""

    def __init__(self, engine: FSDPEngine, layout: ParallelLayout) -> None:
        """Read the model's sizes and the device's peak FLOP/s (measured once on a CPU without a cached figure)."""
        self.engine = engine
        self.shape = model_flops_shape(engine.module)
        engine.pop_work()  # count from here
        self.ranks_per_shard = layout.tp * layout.sp
        self.peak_flops, what = device_peak_flops(engine.device, torch.get_num_threads())
        self._remeasured = False
        if self.peak_flops is None:
            logger.warning("perf/mfu/* is not logged: the device's peak FLOP/s is unknown (%s)", what)

    def metrics(self, stage: str, seconds: float) -> dict[str, float]:
        """`perf/mfu/{stage}` for the engine's forwards (and backwards) since the last reading, done in `seconds`,
        and `perf/max_memory_allocated_gb`."""
        work = self.engine.pop_work()
        metrics = {"perf/max_memory_allocated_gb": peak_memory_gb(self.engine.device)}
        if self.peak_flops is None or seconds <= 0:
            return metrics
        flops = sum(
            compute_model_flops(self.shape, w.num_tokens, w.attention_pairs, w.num_projected, backward=training)
            for training, w in work.items()
        )
        mfu = compute_mfu(flops / self.ranks_per_shard, seconds, self.peak_flops)
        if mfu > 1.0 and self.engine.device.type == "cpu" and not self._remeasured:
            # Impossible: the cached peak is too low (measured while other work ran). Measure again, once, loudly.
            self._remeasured = True
            old = self.peak_flops
            self.peak_flops = cpu_peak_flops(torch.get_num_threads(), remeasure=True)
            logger.warning("perf/mfu/%s came out at %.0f%% against a peak of %.1f GFLOP/s: the peak was measured "
                           "again (%.1f GFLOP/s) and replaces the cached figure", stage, 100 * mfu, old / 1e9,
                           self.peak_flops / 1e9)
            mfu = compute_mfu(flops / self.ranks_per_shard, seconds, self.peak_flops)
        metrics[f"perf/mfu/{stage}"] = mfu
        return metrics
