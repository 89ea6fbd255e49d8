"""GRPO on SmolLM2 on this node's GPUs, a few steps per setting, and a table of what each step cost.

Settings: the hf, native and (when installed) vllm rollouts on 1 GPU, hf with parameter and optimizer offload,
LoRA, and hf on every GPU of the node (when there are 2 or more). Each runs the demo's data and reward
(reasoning-gym two-term arithmetic, 8 prompts x 8 samples, <= 48 new tokens) for `--steps` steps in bf16, on
the embedded Ray cluster, without validation or checkpoints. The table shows, averaged over the steps after the
first (warm-up): seconds per step and of generation and update, tokens processed per second over the whole step,
the actor update's MFU (model FLOPs over the GPU's dense bf16 peak) and the peak GPU memory of a worker.

    python benchmarks/gpu_smoke.py --steps 4          # (benchmarks/gpu_smoke.sh runs this after the GPU tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "outputs" / "demo" / "data"

COLUMNS = (
    ("step s", "timing_s/step"), ("gen s", "timing_s/gen"), ("update s", "timing_s/update_actor"),
    ("tokens/s", "perf/throughput_step"), ("MFU update", "perf/mfu/actor"), ("MFU log-prob", "perf/mfu/actor_infer"),
    ("peak GiB", "perf/max_memory_allocated_gb"),
)


def settings(num_gpus: int) -> dict[str, list[str]]:
    """Setting name -> command-line overrides of the demo config."""
    one = ["trainer.n_gpus_per_node=1"]
    runs = {
        "hf, 1 GPU": [*one, "actor_rollout_ref.rollout.name=hf"],
        "native, 1 GPU": [*one, "actor_rollout_ref.rollout.name=native"],
        "hf + param/optimizer offload, 1 GPU": [
            *one, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        ],
        "hf + LoRA r=16, 1 GPU": [*one, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.lora_rank=16",
                                  "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.actor.optim.lr=1e-4"],
    }
    if importlib.util.find_spec("vllm") is not None:
        runs["vllm, 1 GPU"] = [*one, "actor_rollout_ref.rollout.name=vllm"]
    if num_gpus >= 2:
        runs[f"hf, {num_gpus} GPUs"] = [f"trainer.n_gpus_per_node={num_gpus}", "actor_rollout_ref.rollout.name=hf"]
    return runs


def prepare_data() -> None:
    """The demo's parquet files (written once, offline)."""
    if not (DATA / "train.parquet").is_file():
        subprocess.run([sys.executable, "-m", "hybridflow.data.preprocess.reasoning_gym", "--preset", "smollm2_easy",
                        "--local_dir", str(DATA), "--train_size", "512", "--test_size", "64", "--seed", "0"],
                       cwd=REPO, check=True)


def run(overrides: list[str], steps: int, run_dir: Path) -> dict[int, dict]:
    """The demo config on CUDA with `overrides` for `steps` steps; its per-step metrics."""
    command = [
        sys.executable, "-m", "hybridflow.trainer.main_ppo", "--config-name", "grpo_smollm2_demo",
        "trainer.device=cuda", f"trainer.total_training_steps={steps}", "data.val_files=[]",
        "trainer.val_before_train=False", "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[file]", *overrides,
    ]
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return records


def summarize(records: dict[int, dict]) -> dict[str, float]:
    """Means over the steps after the first of each column's metric (tokens/s: total tokens / step seconds)."""
    steps = [record for step, record in sorted(records.items()) if step > 1] or list(records.values())
    for record in steps:
        record["perf/throughput_step"] = record["perf/total_num_tokens"] / record["timing_s/step"]
    return {key: statistics.mean(r[key] for r in steps if key in r) if any(key in r for r in steps) else float("nan")
            for _, key in COLUMNS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", help="run only the settings whose name contains this text")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke needs CUDA devices; this host has none")
    num_gpus = torch.cuda.device_count()
    prepare_data()
    print(f"{torch.cuda.get_device_name(0)} x {num_gpus}, torch {torch.__version__}, {args.steps} steps per setting")
    rows = []
    for name, overrides in settings(num_gpus).items():
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            try:
                rows.append((name, summarize(run(overrides, args.steps, Path(run_dir)))))
            except subprocess.CalledProcessError as err:
                rows.append((name, {"error": f"exit {err.returncode}"}))
    print("| setting | " + " | ".join(title for title, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for name, values in rows:
        if "error" in values:
            print(f"| {name} | failed: {values['error']} (see the log above) |")
            continue
        cells = [f"{values[key]:.1%}" if key.startswith("perf/mfu") else f"{values[key]:.2f}" for _, key in COLUMNS]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
