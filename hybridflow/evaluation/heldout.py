"""`hybridflow eval`: greedy accuracy of models on held-out reasoning-gym problems, with 95% intervals.

The problems come from the task's own generator under a seed of their own, and every question that appears in
an `--exclude` parquet (the training and validation files) is dropped, so no model is scored on a problem it
trained on. Generation is Hugging Face `generate` (greedy, no sampling), independent of the trainer's rollout
engines; answers are scored by the task's verifier (`score_answer`, exact match) after two extractions:
strict (the text after the last 'Answer:') and flexible (that, else the last number). Two prompts are asked:
`ours` (the training rows' question + answer-format instruction) and `plain` (the bare question), because a
gain that only holds under the training prompt is a gain in formatting, not in the task.

    hybridflow eval --model smollm2-135m-instruct --model outputs/demo/run/global_step_14 \
        --preset smollm2_easy --num_problems 256 --exclude outputs/demo/data/train.parquet \
        --exclude outputs/demo/data/test.parquet --json benchmarks/results/heldout.json

`--samples N` also samples N responses per problem (at `--temperature`, no top-k/top-p, as the trainer's rollouts
do) and reports pass@k for k = 1, 2, 4, ..., N (the unbiased estimator): what sampling can find, which bounds what
RL can sharpen into the greedy answer.

A `--model` is a catalogue name, a Hugging Face directory, a trainer checkpoint (`global_step_N` or its `actor/`,
merged into a temporary directory first) or a run directory (`trainer.default_local_dir`: its latest checkpoint). The first model is the baseline: each other
model's gain is reported as a paired difference on the same problems, with its own 95% interval.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.algorithms.validation_metrics import compute_mean_interval
from hybridflow.data.preprocess.reasoning_gym import PRESETS, answer_disagrees, build_prompt

PROMPT_STYLES = ("ours", "plain")
EXTRACTIONS = ("strict", "flexible")
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    entry: dict[str, Any]


def excluded_questions(parquet_paths: Sequence[str | Path]) -> set[str]:
    """The `extra_info['question']` of every row in the given parquet files (the prompts a run saw)."""
    import pyarrow.parquet as pq

    questions: set[str] = set()
    for path in parquet_paths:
        table = pq.read_table(path, columns=["extra_info"])
        for info in table.column("extra_info").to_pylist():
            if not info or "question" not in info:
                raise ValueError(f"--exclude {path}: a row has no extra_info['question']; pass reasoning-gym rows")
            questions.add(info["question"])
    return questions


def heldout_problems(task: str, task_config: dict[str, Any], num_problems: int, seed: int,
                     exclude: set[str]) -> tuple[list[Problem], Any]:
    """`num_problems` distinct questions from the task's generator under `seed`, none of them in `exclude`;
    also the dataset, whose `score_answer` verifies answers."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, seed=seed, size=8 * num_problems + 64, **task_config)
    problems: list[Problem] = []
    seen = set(exclude)
    for index in range(len(dataset)):
        entry = dataset[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        if answer_disagrees(task, entry):  # a mislabelled question (see there) is no test of the model
            continue
        problems.append(Problem(entry["question"], str(entry["answer"]), entry))
        if len(problems) == num_problems:
            return problems, dataset
    raise ValueError(f"task {task!r} gave only {len(problems)} held-out questions under seed {seed}; "
                     "lower --num_problems or widen the task config")


def user_message(question: str, style: str) -> str:
    if style == "ours":
        return build_prompt(question)
    if style == "plain":
        return question
    raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, got {style!r}")


def paired_gain_interval(base: Sequence[bool], other: Sequence[bool], z: float = Z95) -> tuple[float, float, float]:
    """(mean, low, high) of `other - base` over the same problems: the normal interval of paired differences."""
    if len(base) != len(other) or not base:
        raise ValueError("paired_gain_interval needs two equally long, non-empty lists")
    diffs = [float(o) - float(b) for b, o in zip(base, other)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def score_responses(problems: Sequence[Problem], responses: Sequence[str], dataset: Any) -> dict[str, list[bool]]:
    """Per extraction, whether each response's extracted answer is verified exactly correct."""
    from hybridflow.rewards.score.reasoning_gym import extract_answer, extract_answer_flexible

    extractors = {"strict": extract_answer, "flexible": extract_answer_flexible}
    correct: dict[str, list[bool]] = {}
    for name, extract in extractors.items():
        marks = []
        for problem, response in zip(problems, responses, strict=True):
            answer = extract(response)
            marks.append(answer is not None and float(dataset.score_answer(answer, problem.entry)) >= 1.0)
        correct[name] = marks
    return correct


def resolve_eval_model(model: str, scratch: Path) -> str:
    """A directory `from_pretrained` loads: catalogue names and HF dirs as they are, checkpoints merged."""
    from hybridflow.engines.training.merge import find_checkpoint_dir, merge_checkpoint
    from hybridflow.models.catalogue import resolve_model_path

    from hybridflow.trainer.checkpoint_dirs import LATEST_FILE, list_checkpoints, step_dir

    path = Path(model)
    committed = list_checkpoints(path) if path.is_dir() else []
    if (path / LATEST_FILE).is_file() or committed:  # a run directory: its newest complete checkpoint
        if not committed:  # (the pointer file may lag the directories, or name one that is gone)
            raise FileNotFoundError(f"{path} is a run directory without a complete checkpoint to evaluate")
        path = step_dir(path, committed[-1])
    if path.is_dir():
        try:
            ckpt = find_checkpoint_dir(path)
        except FileNotFoundError:  # a plain HF directory
            return resolve_model_path(path)
        target = scratch / f"merged_{len(list(scratch.iterdir()))}"
        merge_checkpoint(ckpt, target)
        return str(target)
    return resolve_model_path(model)


def generate_responses(model_dir: str, messages: Sequence[str], max_new_tokens: int, batch_size: int,
                       num_samples: int = 1, temperature: float = 0.0, seed: int = 0) -> list[list[str]]:
    """`num_samples` completions of each user message (chat template, left padding, fp32), at most `batch_size`
    sequences per `generate` call. temperature 0: greedy; above 0: sampled from softmax(logits / temperature) over
    the whole vocabulary (no top-k / top-p, as the trainer's rollouts sample), seeded with `seed`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                           add_generation_prompt=True) for m in messages]
    sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                else {"do_sample": False})
    prompts_per_call = max(1, batch_size // num_samples)
    torch.manual_seed(seed)
    out: list[list[str]] = []
    with torch.inference_mode():
        for start in range(0, len(texts), prompts_per_call):
            batch = tokenizer(texts[start:start + prompts_per_call], return_tensors="pt", padding=True,
                              add_special_tokens=False)
            generated = model.generate(**batch, **sampling, num_return_sequences=num_samples,
                                       max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            decoded = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            out.extend(decoded[i:i + num_samples] for i in range(0, len(decoded), num_samples))
    return out


def greedy_responses(model_dir: str, messages: Sequence[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """The greedy completion of each user message (`generate_responses` with one greedy sample)."""
    return [samples[0] for samples in generate_responses(model_dir, messages, max_new_tokens, batch_size)]


def sampled_responses(model_dir: str, messages: Sequence[str], max_new_tokens: int, batch_size: int,
                      num_samples: int, temperature: float, seed: int) -> list[list[str]]:
    """`num_samples` sampled completions of each user message at `temperature` > 0 (`generate_responses`)."""
    if temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    return generate_responses(model_dir, messages, max_new_tokens, batch_size, num_samples, temperature, seed)


def compute_pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem from `num_correct` right answers in `num_samples` samples:
    1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold a right one."""
    if not 1 <= k <= num_samples or not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={num_samples}, c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def pass_at_k_levels(num_samples: int) -> list[int]:
    """The k reported for `num_samples` samples: 1, 2, 4, ... and n itself."""
    levels = [1 << i for i in range(num_samples.bit_length()) if 1 << i < num_samples]
    return levels + [num_samples]


def sampled_record(problems: Sequence[Problem], samples: Sequence[Sequence[str]], dataset: Any) -> dict[str, Any]:
    """Per-problem right-answer counts of sampled responses (flexible extraction) and the mean pass@k for each
    `pass_at_k_levels` k: what sampling finds, the most RL can sharpen into the greedy answer."""
    num_samples = len(samples[0])
    counts = []
    for problem, responses in zip(problems, samples, strict=True):
        marks = score_responses([problem] * len(responses), responses, dataset)["flexible"]
        counts.append(sum(marks))
    pass_at = {str(k): sum(compute_pass_at_k(num_samples, c, k) for c in counts) / len(counts)
               for k in pass_at_k_levels(num_samples)}
    return {"num_samples": num_samples, "sampled_correct": counts, "pass_at_k": pass_at}


def evaluate(models: Sequence[str], problems: Sequence[Problem], dataset: Any, styles: Sequence[str],
             max_new_tokens: int, batch_size: int, num_samples: int = 0, temperature: float = 1.0,
             sample_seed: int = 0) -> list[dict[str, Any]]:
    """One record per (model, prompt style): accuracy per extraction with its interval, and the samples; with
    `num_samples` > 0 also pass@k of that many sampled responses per problem at `temperature`."""
    records = []
    with tempfile.TemporaryDirectory(prefix="hybridflow_eval_") as scratch:
        for model in models:
            model_dir = resolve_eval_model(model, Path(scratch))
            for style in styles:
                messages = [user_message(p.question, style) for p in problems]
                responses = greedy_responses(model_dir, messages, max_new_tokens, batch_size)
                correct = score_responses(problems, responses, dataset)
                record: dict[str, Any] = {"model": model, "prompt": style, "num_problems": len(problems),
                                          "correct": correct, "examples": responses[:4]}
                for name, marks in correct.items():
                    low, high = compute_mean_interval([float(mark) for mark in marks])  # Wilson for 0/1 marks
                    record[f"acc_{name}"] = sum(marks) / len(marks)
                    record[f"acc_{name}_ci95"] = [low, high]
                if num_samples > 0:
                    samples = sampled_responses(model_dir, messages, max_new_tokens, batch_size, num_samples,
                                                temperature, sample_seed)
                    record.update(sampled_record(problems, samples, dataset), temperature=temperature)
                records.append(record)
    for record in records:
        base = next(r for r in records if r["model"] == models[0] and r["prompt"] == record["prompt"])
        for name in EXTRACTIONS:
            mean, low, high = paired_gain_interval(base["correct"][name], record["correct"][name])
            record[f"gain_{name}"] = mean
            record[f"gain_{name}_ci95"] = [low, high]
    return records


def format_table(records: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | prompt | strict acc [95% CI] | flexible acc [95% CI] | gain (flexible) [95% CI] |",
             "|---|---|---|---|---|"]
    for r in records:
        def pct(key: str) -> str:
            low, high = r[f"{key}_ci95"]
            return f"{100 * r[key]:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
        lines.append(f"| {r['model']} | {r['prompt']} | {pct('acc_strict')} | {pct('acc_flexible')} | "
                     f"{pct('gain_flexible')} |")
    sampled = [r for r in records if "pass_at_k" in r]
    if sampled:
        levels = list(sampled[0]["pass_at_k"])
        lines += ["", f"sampled at temperature {sampled[0]['temperature']} (flexible extraction):",
                  "| model | prompt | " + " | ".join(f"pass@{k}" for k in levels) + " |",
                  "|---|---|" + "---|" * len(levels)]
        lines += [f"| {r['model']} | {r['prompt']} | " + " | ".join(f"{100 * r['pass_at_k'][k]:.1f}%" for k in levels)
                  + " |" for r in sampled]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybridflow eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True,
                        help="catalogue name, HF directory or trainer checkpoint; repeat; the first is the baseline")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="the task + config a training preset used")
    parser.add_argument("--task", help="reasoning-gym task (instead of --preset)")
    parser.add_argument("--task_config", default="{}", help="JSON object of task config fields (over the preset's)")
    parser.add_argument("--num_problems", type=int, default=256)
    parser.add_argument("--seed", type=int, default=12345, help="the held-out generator seed (not the training one)")
    parser.add_argument("--exclude", action="append", default=[], help="parquet whose questions are left out")
    parser.add_argument("--prompt", action="append", choices=PROMPT_STYLES, help="prompt styles (default: both)")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--batch_size", type=int, default=64, help="sequences per generate call")
    parser.add_argument("--samples", type=int, default=0,
                        help="also sample this many responses per problem and report pass@k (0: greedy only)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of --samples")
    parser.add_argument("--sample_seed", type=int, default=0, help="torch seed of --samples")
    parser.add_argument("--json", help="write the records (with per-problem marks) to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_problems <= 0:
        raise SystemExit("--num_problems must be > 0")
    if args.samples < 0 or (args.samples and args.temperature <= 0):
        raise SystemExit("--samples must be >= 0, and sampling needs --temperature > 0 (greedy is always reported)")
    task, config = args.task, {}
    if args.preset:
        task, preset_config, _ = PRESETS[args.preset]
        config = dict(preset_config)
    if not task:
        raise SystemExit("pass --preset or --task")
    config.update(json.loads(args.task_config))
    problems, dataset = heldout_problems(task, config, args.num_problems, args.seed,
                                         excluded_questions(args.exclude))
    records = evaluate(args.model, problems, dataset, args.prompt or list(PROMPT_STYLES), args.max_new_tokens,
                       args.batch_size, args.samples, args.temperature, args.sample_seed)
    print(format_table(records))
    if args.json:
        from hybridflow.utils.host import host_facts

        payload = {"host": host_facts(), "task": task, "task_config": config, "seed": args.seed,
                   "excluded": args.exclude, "max_new_tokens": args.max_new_tokens, "samples": args.samples,
                   "temperature": args.temperature, "sample_seed": args.sample_seed, "records": records}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
