"""Data for the calculator-agent recipe: RL rows for the tool agent, plus SFT demonstrations of tool use.

SmolLM2-135M-Instruct never writes a `<tool_call>` block on its own (0 of 16 sampled answers to the tool
prompt), so GRPO alone has nothing to reinforce. The recipe first fine-tunes on short demonstrations
(question -> calculator call -> tool result -> "Answer: <result>"), rendered with the same system prompt the
tool agent adds for templates that ignore `tools`, then runs GRPO with `rollout.mode=async` and the tool agent.

    python examples/calculator_agent/make_data.py --local_dir outputs/calculator_agent/data
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import pandas as pd

from hybridflow.agents.chat import hermes_tool_prompt
from hybridflow.data.preprocess.reasoning_gym import PRESETS, build_rows
from hybridflow.tools.calculator import CalculatorTool, evaluate_expression, format_number


def demonstration(question_prompt: str, system_prompt: str, use_tool: bool = True) -> list[dict]:
    """One conversation for a 'Calculate <expr>.' question: a calculator call, its result, then the answer; or,
    with `use_tool` False, the answer written directly (the model cannot compute most of these itself, so
    imitating it teaches the format, not the arithmetic)."""
    match = re.search(r"Calculate (.+?)\.", question_prompt)
    if match is None:
        raise ValueError(f"no 'Calculate <expression>.' in the prompt {question_prompt!r}")
    expression = match.group(1)
    result = format_number(evaluate_expression(expression), 12)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    if not use_tool:
        return [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": question_prompt},
            {"role": "assistant", "content": f"Answer: {result}"},
        ]
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": question_prompt},
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_dir", required=True)
    parser.add_argument("--rl_train_size", type=int, default=256)
    parser.add_argument("--test_size", type=int, default=64)
    parser.add_argument("--sft_size", type=int, default=256)
    parser.add_argument("--tool_fraction", type=float, default=1.0,
                        help="share of SFT demonstrations that call the calculator; the rest answer directly, so "
                             "the warmed-up model calls the tool only sometimes and RL has a choice to reinforce")
    args = parser.parse_args()
    if not 0.0 <= args.tool_fraction <= 1.0:
        parser.error(f"--tool_fraction must lie in [0, 1], got {args.tool_fraction}")
    out = Path(args.local_dir)
    out.mkdir(parents=True, exist_ok=True)
    task, config, extraction = PRESETS["smollm2_calculator"]
    rl = build_rows(task, config, args.rl_train_size, args.test_size, seed=0, answer_extraction=extraction,
                    agent_name="tool_agent")
    # SFT questions come from another seed; the RL test split stays unseen by both trainers.
    sft = build_rows(task, config, args.sft_size, 0, seed=1, answer_extraction=extraction, agent_name="tool_agent")
    test_questions = {row["prompt"][0]["content"] for row in rl["test"]}
    system_prompt = hermes_tool_prompt([CalculatorTool().get_openai_tool_schema().to_dict()])
    questions = [row["prompt"][0]["content"] for row in sft["train"]
                 if row["prompt"][0]["content"] not in test_questions]
    with_tool = set(random.Random(0).sample(range(len(questions)), round(args.tool_fraction * len(questions))))
    sft_rows = [{"messages": demonstration(question, system_prompt, use_tool=i in with_tool)}
                for i, question in enumerate(questions)]
    pd.DataFrame(rl["train"]).to_parquet(out / "train.parquet")
    pd.DataFrame(rl["test"]).to_parquet(out / "test.parquet")
    split = max(len(sft_rows) // 8, 1)
    pd.DataFrame(sft_rows[split:]).to_parquet(out / "sft_train.parquet")
    pd.DataFrame(sft_rows[:split]).to_parquet(out / "sft_val.parquet")
    print(f"wrote {len(rl['train'])} RL train, {len(rl['test'])} test, {len(sft_rows) - split} SFT train, "
          f"{split} SFT val rows to {out} ({len(with_tool)} of the SFT rows call the tool)")


if __name__ == "__main__":
    main()
