"""Write train/test parquet files from a reasoning-gym task (offline, procedural).

    python -m hybridflow.data.preprocess.reasoning_gym --task basic_arithmetic --local_dir ~/data/rg \
        --train_size 2000 --test_size 200 --seed 0 [--task_config '{"max_terms": 3}'] [--preset smollm2_easy]

Each row: data_source `reasoning_gym/<task>`, the question plus "End with: Answer: <answer>" as the user
message, `reward_model.ground_truth` the oracle answer, and `extra_info` with `task`, `task_config` (JSON),
`metadata` (the entry's metadata, JSON) and `question`, everything the task's `score_answer` needs later.
Test questions never repeat train questions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

from hybridflow.data.preprocess.common import add_output_args, check_outputs_free, make_row, write_splits

__all__ = ["ANSWER_INSTRUCTION", "PRESETS", "build_prompt", "build_rows", "main"]

logger = logging.getLogger(__name__)

ANSWER_INSTRUCTION = "End with: Answer: <answer>"

# Named task settings: (task, task config, answer extraction). smollm2_easy: two-term 1-2 digit +/-;
# SmolLM2-135M-Instruct rarely writes the "Answer:" line but often states the result in prose, so its
# rows are scored with flexible extraction (the last number when no "Answer:" line is present).
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "smollm2_easy": ("basic_arithmetic", {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
        "allow_parentheses": False, "allow_negation": False,
    }, "flexible"),
    # Three one-digit terms: harder than the demo's task for SmolLM2-135M (14.5% greedy on 256 held-out problems
    # with 64 new tokens; pass@8 35.9% on 128 with 48; 2026-11-28), with enough right answers among 8 samples for
    # GRPO to learn from.
    "smollm2_add3": ("basic_arithmetic", {
        "min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False,
    }, "flexible"),
    # Three terms of up to three digits: hard to do in the head for a 135M model, easy with a calculator.
    "smollm2_calculator": ("basic_arithmetic", {
        "min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 3, "operators": ["+", "-", "*"],
        "allow_parentheses": False, "allow_negation": False,
    }, "flexible"),
}

TOOL_INSTRUCTION = "You can use the calculator tool to compute it."
"""Appended to the question by `--agent_name tool_agent` (the tool's schema itself comes from the tool config)."""


def build_prompt(question: str, tool_instruction: str | None = None) -> str:
    """The user message: the task's question, an optional tool hint, then the answer-format instruction."""
    hint = f" {tool_instruction}" if tool_instruction else ""
    return f"{question}{hint}\n\n{ANSWER_INSTRUCTION}"


def _json_safe(value: Any, where: str) -> Any:
    """Metadata/config as JSON types (tuples -> lists, numpy scalars -> numbers); other types raise."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return [_json_safe(v, where) for v in sorted(value, key=repr)]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    raise TypeError(f"{where} holds a {type(value).__name__}, which cannot be stored as JSON")


def answer_disagrees(task: str, entry: dict[str, Any]) -> bool:
    """Whether a reasoning-gym entry's answer is not the value of the question it asks.

    basic_arithmetic with allow_parentheses=False writes `a + b * c` for the tree (a + b) * c and answers the
    tree's value: 52 of 256 three-term `+ - *` questions (reasoning-gym 0.1.x, measured 2026-11-28), whose "right"
    answer contradicts the usual precedence that a calculator (or the model) follows. Its metadata keeps the
    expression, which the calculator's own evaluator recomputes."""
    if task != "basic_arithmetic":
        return False
    from hybridflow.tools.calculator import evaluate_expression

    try:
        value, answer = float(evaluate_expression(entry["metadata"]["expression"])), float(entry["answer"])
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return False  # nothing to compare: the task's own verifier stands
    return abs(value - answer) > 1e-9 * max(1.0, abs(answer))


def build_rows(task: str, task_config: dict[str, Any], train_size: int, test_size: int,
               seed: int, answer_extraction: str = "strict",
               agent_name: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """{'train': rows, 'test': rows}: distinct questions from one seeded reasoning-gym dataset.

    `answer_extraction` ('strict' or 'flexible') is stored per row for the scorer (see its module).
    `agent_name` (e.g. 'tool_agent') is stored per row for `rollout.mode=async`; tool_agent rows also get
    `TOOL_INSTRUCTION` in the prompt."""
    import reasoning_gym  # the optional `data` extra; imported only when this script runs

    needed = train_size + test_size
    config = {k: v for k, v in task_config.items() if k not in ("seed", "size")}
    dataset = reasoning_gym.create_dataset(task, seed=seed, size=4 * needed + 64, **config)
    config_json = json.dumps(_json_safe(dataclasses.asdict(dataset.config), "task_config"), sort_keys=True)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    mislabelled = 0
    for index in range(len(dataset)):
        entry = dataset[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        if answer_disagrees(task, entry):
            mislabelled += 1
            continue
        split = "train" if len(rows) < train_size else "test"
        row = make_row(
            data_source=f"reasoning_gym/{task}",
            content=build_prompt(entry["question"], TOOL_INSTRUCTION if agent_name == "tool_agent" else None),
            ability="reasoning",
            ground_truth=str(entry["answer"]),
            extra_info={
                "split": split,
                "index": len(rows) if split == "train" else len(rows) - train_size,
                "task": task,
                "task_config": config_json,
                "question": entry["question"],
                "metadata": json.dumps(_json_safe(entry["metadata"], "metadata"), sort_keys=True),
                "answer_extraction": answer_extraction,
            },
        )
        if agent_name is not None:
            row["agent_name"] = agent_name
        rows.append(row)
        if len(rows) == needed:
            if mislabelled:
                logger.warning(
                    "dropped %d of %d %s questions whose answer is not their expression's value under the usual "
                    "operator precedence (the task writes (a + b) * c without its parentheses)",
                    mislabelled, mislabelled + needed, task,
                )
            return {"train": rows[:train_size], "test": rows[train_size:]}
    raise ValueError(
        f"reasoning-gym task {task!r} with config {config} gave only {len(rows)} distinct questions in "
        f"{len(dataset)} tries, fewer than --train_size + --test_size = {needed}; widen the task config"
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", help="reasoning-gym task, e.g. basic_arithmetic, countdown, gsm_symbolic, chain_sum")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named task + config (--task_config overrides)")
    parser.add_argument("--task_config", default="{}", help="JSON object of the task's config fields")
    parser.add_argument("--train_size", type=int, default=1000)
    parser.add_argument("--test_size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answer_extraction", choices=["strict", "flexible"], default=None,
                        help="strict: only the text after 'Answer:'; flexible: else the last number "
                             "(default: the preset's, or strict)")
    parser.add_argument("--agent_name", default=None,
                        help="agent loop per row for rollout.mode=async (single_turn_agent, tool_agent)")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    args = _parse_args(argv)
    task, config, extraction = None, {}, "strict"
    if args.preset:
        task, preset_config, extraction = PRESETS[args.preset]
        config = dict(preset_config)
        if args.task and args.task != task:
            raise ValueError(f"--preset {args.preset} is task {task!r}, but --task {args.task!r} was given")
    task = args.task or task
    if not task:
        raise ValueError("pass --task (e.g. basic_arithmetic) or --preset")
    user_config = json.loads(args.task_config)
    if not isinstance(user_config, dict):
        raise ValueError(f"--task_config must be a JSON object, got {args.task_config!r}")
    config.update(user_config)
    if args.train_size < 0 or args.test_size < 0 or args.train_size + args.test_size == 0:
        raise ValueError(f"--train_size and --test_size must be >= 0 and not both 0, "
                         f"got {args.train_size} and {args.test_size}")
    split_names = [name for name, size in (("train", args.train_size), ("test", args.test_size)) if size > 0]
    check_outputs_free(args.local_dir, split_names, args.overwrite)
    splits = build_rows(task, config, args.train_size, args.test_size, args.seed, args.answer_extraction or extraction,
                        args.agent_name)
    write_splits(args.local_dir, {name: rows for name, rows in splits.items() if rows}, args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
