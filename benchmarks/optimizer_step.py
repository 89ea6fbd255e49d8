"""Time one optimizer step over a model's parameters: torch's per-tensor AdamW loop, its foreach form and its fused
kernel (the engine's default where the device has one), interleaved, on random gradients.

The step does no model work, so it isolates what `optim.override_optimizer_config` (fused / foreach) changes.
Prints a table of the median step per variant and its ratio to the per-tensor loop, measured in the same run;
writes the raw times to benchmarks/results/.

    python benchmarks/optimizer_step.py --model smollm2-135m-instruct --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hybridflow.engines.training import OptimConfig, build_optimizer
from hybridflow.models import resolve_model_path
from hybridflow.utils.device import get_torch_device
from hybridflow.utils.host import write_results

VARIANTS = {"per-tensor loop": {"foreach": False}, "foreach": {"foreach": True}, "fused (default)": None}


def build_module(model: str, device: torch.device) -> torch.nn.Module:
    """The model's architecture with random weights, on `device` (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(model))
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def time_steps(module: torch.nn.Module, override: dict | None, steps: int, device: torch.device) -> list[float]:
    """Seconds per step of `steps` AdamW steps (after one warm-up step that creates the state)."""
    optimizer = build_optimizer(module, OptimConfig(lr=1e-5, override_optimizer_config=override))
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        optimizer.step()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all variants, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    device = get_torch_device()
    module = build_module(args.model, device)
    generator = torch.Generator(device=device).manual_seed(0)
    for param in module.parameters():
        param.grad = torch.randn(param.shape, generator=generator, device=device) * 1e-3
    numel = sum(param.numel() for param in module.parameters())
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, override in VARIANTS.items():
            if override == {"foreach": True} and device.type == "cpu":
                continue  # torch has no foreach kernels for CPU tensors
            times[name] += time_steps(module, override, args.steps, device)
    baseline = statistics.median(times["per-tensor loop"])
    rows = []
    print(f"{args.model}: {numel / 1e6:.1f}M parameters, {device}, torch {torch.__version__}, "
          f"load {load_before[0]:.2f} at start")
    print(f"{'variant':<18}{'median step':>14}{'vs loop':>10}")
    for name, samples in times.items():
        if not samples:
            continue
        median = statistics.median(samples)
        rows.append({"variant": name, "median_s": median, "samples_s": samples, "ratio_to_loop": median / baseline})
        print(f"{name:<18}{median * 1e3:>11.1f} ms{median / baseline:>9.2f}x")
    path = write_results("optimizer_step", vars(args) | {"numel": numel, "device": str(device)}, rows, load_before)
    print(f"raw: {path}")


if __name__ == "__main__":
    main()
