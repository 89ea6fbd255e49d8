"""TRL's GRPOTrainer on the demo's model, prompts, batch and lengths: the baseline for hybridflow's step time.

Runs in its own environment so TRL's pins never touch hybridflow's:

    python3 -m venv benchmarks/.venv-trl
    benchmarks/.venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 reasoning-gym==0.1.25 tensordict==0.15.3 pyarrow
    PYTHONPATH=. benchmarks/.venv-trl/bin/python benchmarks/trl_grpo_baseline.py \
        --model ~/.cache/hybridflow/models/smollm2-135m-instruct --data outputs/demo/data/train.parquet

Same settings as `hybridflow/trainer/config/grpo_smollm2_demo.yaml`: 8 prompts x 8 samples per step,
48 new tokens, temperature 0.7, lr 1e-5, no KL term, fp32 on CPU, and the same reasoning-gym scorer.
Prints a table of per-step wall times (the first step, which includes warm-up, is reported apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pandas as pd


def build_dataset(path: str, limit: int):
    from datasets import Dataset

    frame = pd.read_parquet(path).head(limit)
    rows = [
        {
            "prompt": list(row["prompt"]),
            "ground_truth": row["reward_model"]["ground_truth"],
            "data_source": row["data_source"],
            "extra_info": json.dumps(dict(row["extra_info"])),
        }
        for _, row in frame.iterrows()
    ]
    return Dataset.from_list(rows)


def reasoning_gym_reward(completions, ground_truth, data_source, extra_info, **kwargs):
    """hybridflow's own scorer, so both trainers optimise the same reward."""
    from hybridflow.rewards.score.reasoning_gym import compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [
        compute_score(source, text, truth, json.loads(info))
        for text, truth, source, info in zip(texts, ground_truth, data_source, extra_info, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF directory of SmolLM2-135M-Instruct (fp32)")
    parser.add_argument("--data", required=True, help="train.parquet from the demo's preprocess step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--output-dir", default="outputs/trl_baseline")
    parser.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on",
                        help="TRL turns it on by default; off is faster when memory allows")
    parser.add_argument("--json", action="store_true",
                        help="print one `STEP_JSON {...}` line per step (time, tokens, response length)")
    args = parser.parse_args()

    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    step_ends: list[float] = []
    step_logs: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, *callback_args, **callback_kwargs):
            step_ends.append(time.perf_counter())

        def on_log(self, *callback_args, logs=None, **callback_kwargs):
            if logs and "num_tokens" in logs:
                step_logs.append(dict(logs))

    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=args.prompts_per_step * args.n,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=0.7,
        learning_rate=1e-5,
        beta=0.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        gradient_checkpointing=args.gradient_checkpointing == "on",
    )
    dataset = build_dataset(args.data, args.steps * args.prompts_per_step * 2)
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=reasoning_gym_reward, args=config, train_dataset=dataset, callbacks=[StepTimer()]
    )
    start = time.perf_counter()
    trainer.train()
    times = [end - begin for begin, end in zip([start, *step_ends[:-1]], step_ends, strict=True)]
    if args.json:
        seen = 0.0
        for step, (seconds, logs) in enumerate(zip(times, step_logs), start=1):
            print("STEP_JSON", json.dumps({
                "step": step, "seconds": seconds, "tokens": logs["num_tokens"] - seen,
                "response_length": logs.get("completions/mean_length"), "reward": logs.get("reward"),
            }))
            seen = logs["num_tokens"]
        return
    rest = times[1:] or times
    print(f"{'trainer':<22}{'first step s':>14}{'mean later step s':>20}{'steps':>7}")
    print(f"{'TRL GRPOTrainer':<22}{times[0]:>14.1f}{statistics.mean(rest):>20.1f}{len(times):>7}")


if __name__ == "__main__":
    main()
