"""TRL's GRPOTrainer on the demo's model, prompts, batch and lengths: the baseline for hybridflow's step time.

Runs in its own environment so TRL's pins never touch hybridflow's:

    python3 -m venv benchmarks/.venv-trl
    benchmarks/.venv-trl/bin/pip install torch==2.13.0 trl==1.16.0 reasoning-gym==0.1.25 tensordict==0.15.3 pyarrow
    PYTHONPATH=. benchmarks/.venv-trl/bin/python benchmarks/trl_grpo_baseline.py \
        --model ~/.cache/hybridflow/models/smollm2-135m-instruct --data outputs/demo/data/train.parquet

Two recipes (`--recipe`), both with 8 prompts x 8 samples per step, no KL term, fp32 on CPU and hybridflow's
reasoning-gym scorer:
- `speed` (default): the step-time comparison of `benchmarks/e2e_grpo.py` (48 new tokens, temperature 0.7,
  lr 1e-5 constant), as the demo was when it was measured;
- `demo`: the learning comparison at the demo's settings (`grpo_smollm2_demo.yaml`): 32 new tokens,
  temperature 1.0, lr 2e-5 decayed on a cosine to 0.1x, AdamW weight decay 0.01, gradient clip 1.0, token-mean loss
  (TRL's `dapo`), group-normalised advantages, one update per generation. TRL has no entropy bonus, so the demo's
  0.003 is the one setting it lacks. `--save-dir` keeps the final model (an HF directory) for `hybridflow eval`,
  and `--metrics-file` writes each step's seconds as hybridflow's metrics.jsonl does (`benchmarks/demo_recipe_search.py`
  runs both as its `trl_*` candidates).
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
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 48 (speed), 32 (demo)")
    parser.add_argument("--recipe", choices=["speed", "demo"], default="speed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default=None, help="save the final model (HF format) here")
    parser.add_argument("--metrics-file", default=None, help="append {'step', 'timing_s/step'} lines here")
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

    if args.recipe == "demo":
        recipe = dict(
            temperature=1.0, learning_rate=2e-5, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.01, max_grad_norm=1.0, loss_type="dapo",
            scale_rewards="group",
        )
        max_new_tokens = args.max_new_tokens or 32
    else:
        recipe = dict(temperature=0.7, learning_rate=1e-5)
        max_new_tokens = args.max_new_tokens or 48
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=args.prompts_per_step * args.n,
        num_generations=args.n,
        max_completion_length=max_new_tokens,
        beta=0.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing == "on",
        **recipe,
    )
    dataset = build_dataset(args.data, args.steps * args.prompts_per_step * 2)
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=reasoning_gym_reward, args=config, train_dataset=dataset, callbacks=[StepTimer()]
    )
    start = time.perf_counter()
    trainer.train()
    times = [end - begin for begin, end in zip([start, *step_ends[:-1]], step_ends, strict=True)]
    if args.save_dir:
        trainer.save_model(args.save_dir)
        trainer.processing_class.save_pretrained(args.save_dir)
    if args.metrics_file:
        with open(args.metrics_file, "a") as metrics:
            for step, (seconds, logs) in enumerate(zip(times, step_logs), start=1):
                metrics.write(json.dumps({"step": step, "timing_s/step": seconds, "reward": logs.get("reward")}) + "\n")
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
