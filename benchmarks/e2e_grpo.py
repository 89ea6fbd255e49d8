"""hybridflow against TRL's GRPOTrainer, back to back, on the demo's model, prompts, reward, batch and lengths.

Both trainers run `--steps` GRPO steps of 8 prompts x 8 samples (<= 48 new tokens, temperature 0.7, lr 1e-5,
no KL term, fp32 on this CPU). TRL runs in its own environment (see `trl_grpo_baseline.py`) twice: with its
default gradient checkpointing and without it; the faster one is the baseline. The table reports per-step
seconds and tokens processed per second over the whole step (prompt + response tokens of every sample / step
time), averaged over the steps after the first (warm-up), and hybridflow's ratio to the baseline:

    python benchmarks/e2e_grpo.py --trl-python /tmp/venv-trl/bin/python --steps 3
    python benchmarks/e2e_grpo.py --trl-python /tmp/venv-trl/bin/python --steps 3 --preamble-tokens 200

`--preamble-tokens N` is the long-prompt setting: every prompt's user message starts with the same block of
about N tokens of reference text (a table of sums the question does not need), so prompts are about N + 50
tokens and the 8 samples of a prompt share that much more; both trainers read the same rewritten parquet.
Response lengths drift apart as the two policies learn; the first steps, from the same base model, are the
fairest comparison, and tokens per second normalises what remains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridflow.trainer.plot import metrics_by_step

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "outputs" / "demo" / "data" / "train.parquet"
# trl_grpo_baseline.py's speed settings, which the demo config's own recipe (lr 2e-5 on a cosine, entropy bonus
# 0.003, temperature 1.0, 32 tokens) differs from; TRL has no entropy bonus, so neither side computes its gradient
TRL_MATCHED_SETTINGS = ("actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.rollout.temperature=0.7",
                        "data.max_response_length=48", "actor_rollout_ref.actor.entropy_coeff=0.0",
                        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant")


def run_hybridflow(steps: int, run_dir: Path, data: Path, max_prompt_length: int) -> list[dict]:
    """The demo config on `data` for `steps` steps without validation or checkpoints; its per-step metrics."""
    command = [
        sys.executable, "-m", "hybridflow.trainer.main_ppo", "--config-name", "grpo_smollm2_demo",
        f"trainer.total_training_steps={steps}", "data.val_files=[]", "trainer.val_before_train=False",
        "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]",
        f"data.train_files=[{data}]", f"data.max_prompt_length={max_prompt_length}",
        *TRL_MATCHED_SETTINGS,
    ]
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    records = metrics_by_step(run_dir)
    return [
        {"step": step, "seconds": r["timing_s/step"], "tokens": r["perf/total_num_tokens"],
         "response_length": r["response_length/mean"], "reward": r["critic/score/mean"]}
        for step, r in sorted(records.items()) if step > 0
    ]


def run_trl(
    python: str, model: Path, steps: int, gradient_checkpointing: str, out_dir: Path, data: Path
) -> list[dict]:
    """TRL's GRPOTrainer through `trl_grpo_baseline.py --json`; its per-step records."""
    command = [
        python, str(REPO / "benchmarks" / "trl_grpo_baseline.py"), "--model", str(model), "--data", str(data),
        "--steps", str(steps), "--gradient-checkpointing", gradient_checkpointing, "--json",
        "--output-dir", str(out_dir),
    ]
    result = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    marker = "STEP_JSON "
    return [json.loads(line[len(marker):]) for line in result.stdout.splitlines() if line.startswith(marker)]


def summarize(records: list[dict]) -> dict[str, float]:
    """Means over the steps after the first (all steps when there is only one)."""
    later = records[1:] or records
    seconds = statistics.mean(r["seconds"] for r in later)
    tokens = statistics.mean(r["tokens"] for r in later)
    return {
        "first_step_s": records[0]["seconds"],
        "step_s": seconds,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / seconds,
        "response_length": statistics.mean(r["response_length"] for r in later),
    }


PREAMBLE_LINE = "Reference: {a} + {b} = {c}."


def write_long_prompt_data(source: Path, target: Path, preamble_tokens: int, tokenizer) -> int:
    """`source` with the same reference block of about `preamble_tokens` tokens before every user message;
    returns the block's token count."""
    import pyarrow.parquet as pq

    lines, block = [], ""
    while len(tokenizer(block)["input_ids"]) < preamble_tokens:
        index = len(lines)
        lines.append(PREAMBLE_LINE.format(a=100 + index, b=7 * index % 50, c=100 + index + 7 * index % 50))
        block = " ".join(lines)
    table = pq.read_table(source).to_pylist()
    for row in table:
        for message in row["prompt"]:
            if message["role"] == "user":
                message["content"] = f"{block}\n\n{message['content']}"
                break
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), target)
    return len(tokenizer(block)["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-python", required=True, help="python of an environment with trl (see trl_grpo_baseline.py)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default=None, help="HF directory of SmolLM2 (default: the converted catalogue copy)")
    parser.add_argument("--preamble-tokens", type=int, default=0, help="long-prompt setting: tokens added to prompts")
    args = parser.parse_args()
    from hybridflow import env
    from hybridflow.models import resolve_model_path
    from hybridflow.utils.host import write_results

    load_before = list(os.getloadavg())

    model = Path(args.model or resolve_model_path("smollm2-135m-instruct"))
    if not DEMO_DATA.is_file():
        raise SystemExit(f"{DEMO_DATA} is missing: run `make demo` once (it writes the demo data first)")
    with tempfile.TemporaryDirectory(dir=env.cache_dir()) as scratch:
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        data, max_prompt_length, setting_name = DEMO_DATA, 96, "demo settings"
        if args.preamble_tokens:
            from hybridflow.models import load_tokenizer

            data = Path(scratch) / "long_prompts.parquet"
            added = write_long_prompt_data(DEMO_DATA, data, args.preamble_tokens, load_tokenizer(model))
            max_prompt_length = 96 + added + 16
            setting_name = f"long prompts (+{added} tokens each)"
        runs = {"hybridflow": run_hybridflow(args.steps, Path(scratch) / "hybridflow", data, max_prompt_length)}
        for setting in ("on", "off"):
            runs[f"TRL, gradient checkpointing {setting}"] = run_trl(
                args.trl_python, model, args.steps, setting, Path(scratch) / f"trl_{setting}", data
            )
    summaries = {name: summarize(records) for name, records in runs.items()}
    baseline_name = max((name for name in summaries if name.startswith("TRL")), key=lambda n: summaries[n]["tokens_per_s"])
    baseline = summaries[baseline_name]
    print(f"GRPO, {setting_name}, {args.steps} steps each, run started {started}; baseline: {baseline_name}")
    print("| trainer | first step s | later steps s | tokens / step | tokens / s | response length | tokens/s vs baseline |")
    print("|---|---|---|---|---|---|---|")
    for name, summary in summaries.items():
        print(
            f"| {name} | {summary['first_step_s']:.1f} | {summary['step_s']:.1f} | {summary['tokens_per_step']:.0f} | "
            f"{summary['tokens_per_s']:.1f} | {summary['response_length']:.1f} | "
            f"{summary['tokens_per_s'] / baseline['tokens_per_s']:.2f}x |"
        )
    for name, records in runs.items():
        print(name, [round(r["seconds"], 1) for r in records], "s per step")
    rows = [{"trainer": name, "summary": summaries[name], "steps": records} for name, records in runs.items()]
    config = {**vars(args), "setting": setting_name, "baseline": baseline_name}
    print(f"raw results: {write_results('e2e_grpo', config, rows, load_before)}")


if __name__ == "__main__":
    main()
