"""GRPO on SmolLM2 on this node's GPUs, a few steps per setting, and a table of what each step cost.

Settings: the hf, native and (when installed) vllm rollouts on 1 GPU, hf with parameter and optimizer offload,
LoRA, and hf on every GPU of the node (when there are 2 or more). Each runs the demo's data and reward
(reasoning-gym two-term arithmetic, 8 prompts x 8 samples, <= 48 new tokens) for `--steps` steps in bf16, on
the embedded Ray cluster, without validation or checkpoints. The table shows, averaged over the steps after the
first (warm-up): seconds per step and of generation and update, tokens processed per second over the whole step,
the actor update's MFU (model FLOPs over the GPU's dense bf16 peak) and the peak GPU memory of a worker.

    python benchmarks/gpu_smoke.py --steps 4          # (benchmarks/gpu_smoke.sh runs this after the GPU tests)

A node without the model's weights or reasoning-gym (an offline GPU node) can still measure the path:
`--model DIR --random-init` builds the architecture of DIR's config.json (with DIR's tokenizer) with random
weights, and `--reward-fn benchmarks/answer_match_reward.py` scores without reasoning-gym. Random weights rarely
stop early, so responses run to the length limit: the table then says so in its header.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hybridflow.trainer.plot import metrics_by_step
from hybridflow.utils.device import get_torch_device

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "outputs" / "demo" / "data"

COLUMNS = (
    ("step s", "timing_s/step"), ("gen s", "timing_s/gen"), ("update s", "timing_s/update_actor"),
    ("tokens/s", "perf/throughput_step"), ("response len", "response_length/mean"), ("MFU update", "perf/mfu/actor"), ("MFU log-prob", "perf/mfu/actor_infer"),
    ("peak GiB", "perf/max_memory_allocated_gb"), ("wake s", "timing_s/rollout_wake_up"),
    ("sleep s", "timing_s/rollout_sleep"), ("decode s", "rollout/engine/decode_s"),
    ("graphs captured", "rollout/engine/decode_graph_captures"),
)


def settings(num_gpus: int) -> dict[str, list[str]]:
    """Setting name -> command-line overrides of the demo config."""
    one = ["trainer.n_gpus_per_node=1"]
    runs = {
        "hf, 1 GPU": [*one, "actor_rollout_ref.rollout.name=hf"],
        "native, 1 GPU": [*one, "actor_rollout_ref.rollout.name=native"],
        # the 2026-11-28 H200 smoke spent 2.9 s of a 4.5 s 1.46B step generating 32 tokens, and its update ran
        # 8 micro-batches of 640 tokens: these two isolate the rollout's sleep/wake and the micro-batch size
        "native, rollout kept awake, 1 GPU": [*one, "actor_rollout_ref.rollout.name=native",
                                              "actor_rollout_ref.rollout.free_cache_engine=False"],
        "native + token-budget micro-batches, 1 GPU": [*one, "actor_rollout_ref.rollout.name=native",
                                                       "actor_rollout_ref.actor.use_dynamic_bsz=True"],
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


def random_init_copy(model_dir: Path, target: Path) -> Path:
    """`target`: the architecture of `model_dir`'s config with random weights (bf16, seed 0) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    # initialised on the accelerator: on the host the 1.46B llama's initialisation took most of the 2026-11-27 H200
    # smoke's 150 s before its first step
    with get_torch_device():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters())
    del model  # the GPU memory goes back before training starts
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(target)
    print(f"random-init {config.model_type} from {model_dir}: {params / 1e6:.1f}M parameters -> {target}")
    return target


def run(overrides: list[str], steps: int, run_dir: Path, timeout_s: float) -> dict[int, dict]:
    """The demo config on CUDA with `overrides` for `steps` steps; its per-step metrics."""
    command = [
        sys.executable, "-m", "hybridflow.trainer.main_ppo", "--config-name", "grpo_smollm2_demo",
        "trainer.device=cuda", f"trainer.total_training_steps={steps}", "data.val_files=[]",
        "trainer.val_before_train=False", "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[file]", *overrides,
    ]
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=timeout_s)
    return read_records(run_dir)


def read_records(run_dir: Path) -> dict[int, dict]:
    """The per-step metrics a run wrote to `run_dir/metrics.jsonl` (none if it wrote nothing)."""
    try:
        return metrics_by_step(run_dir)
    except FileNotFoundError:
        return {}


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
    parser.add_argument("--only", action="append",
                        help="run only the settings whose name contains this text (repeatable)")
    parser.add_argument("--model", help="model path or catalogue name (default: the demo config's)")
    parser.add_argument("--random-init", action="store_true",
                        help="random weights in the architecture of --model's config (an offline node's stand-in)")
    parser.add_argument("--reward-fn", help="a custom reward file (custom_reward_function.path)")
    parser.add_argument("--data", type=Path, default=DATA, help="directory of train.parquet (default: the demo's)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one setting may run")
    parser.add_argument("--save-metrics", type=Path,
                        help="copy each setting's metrics.jsonl here (every per-step metric, worker-side timings too)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for every setting")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke needs CUDA devices; this host has none")
    num_gpus = torch.cuda.device_count()
    if args.data == DATA:
        prepare_data()
    common = [f"data.train_files=[{args.data / 'train.parquet'}]", *args.overrides]
    if args.reward_fn:
        common.append(f"custom_reward_function.path={Path(args.reward_fn).resolve()}")
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if args.random_init:
            if not model:
                sys.exit("--random-init needs --model DIR (a directory with config.json and a tokenizer)")
            model = str(random_init_copy(Path(model), Path(scratch) / "random_init"))
        if model:
            common.append(f"actor_rollout_ref.model.path={model}")
        weights = "random weights" if args.random_init else "trained weights"
        print(f"{torch.cuda.get_device_name(0)} x {num_gpus}, torch {torch.__version__}, "
              f"model {args.model or 'of the demo config'} ({weights}), {args.steps} steps per setting")
        print_row("setting", [title for title, _ in COLUMNS])
        print_row("---", ["---"] * len(COLUMNS))
        for name, overrides in settings(num_gpus).items():
            if args.only and not any(text in name for text in args.only):
                continue
            with tempfile.TemporaryDirectory() as run_dir:
                try:
                    records = run([*common, *overrides], args.steps, Path(run_dir), args.timeout)
                    if args.save_metrics:
                        save_metrics(Path(run_dir) / "metrics.jsonl", args.save_metrics, name)
                    values = summarize(records)
                except subprocess.CalledProcessError as err:
                    print_row(name, [f"failed: exit {err.returncode} (see the log above)"])
                    continue
                except subprocess.TimeoutExpired:  # the steps that finished are still worth keeping
                    records = read_records(Path(run_dir))
                    if args.save_metrics and records:
                        save_metrics(Path(run_dir) / "metrics.jsonl", args.save_metrics, f"{name} cut")
                    if len(records) < 2:
                        print_row(name, [f"failed: over {args.timeout:.0f} s"])
                        continue
                    values = summarize(records)
                    name = f"{name} (cut at {args.timeout:.0f} s after {len(records)} steps)"
            # each row as soon as its setting ends, so a node taken back mid-run keeps what was measured
            print_row(name, [f"{values[key]:.1%}" if key.startswith("perf/mfu") else f"{values[key]:.2f}"
                             for _, key in COLUMNS])


def save_metrics(source: Path, directory: Path, setting: str) -> None:
    """`directory/<setting as a file name>.jsonl`: a copy of one setting's per-step metrics."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() else "_" for c in setting).strip("_")
    shutil.copyfile(source, directory / f"{stem}.jsonl")


def print_row(name: str, cells: list[str]) -> None:
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
