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
import re
from pathlib import Path

import pandas as pd

from hybridflow.agents.chat import hermes_tool_prompt
from hybridflow.data.preprocess.reasoning_gym import PRESETS, build_rows
from hybridflow.tools.calculator import CalculatorTool, evaluate_expression, format_number


def demonstration(question_prompt: str, system_prompt: str) -> list[dict]:
    """One tool-use conversation for a 'Calculate <expr>.' question."""
    match = re.search(r"Calculate (.+?)\.", question_prompt)
    if match is None:
        raise ValueError(f"no 'Calculate <expression>.' in the prompt {question_prompt!r}")
    expression = match.group(1)
    result = format_number(evaluate_expression(expression), 12)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
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
    args = parser.parse_args()
    out = Path(args.local_dir)
    out.mkdir(parents=True, exist_ok=True)
    task, config, extraction = PRESETS["smollm2_calculator"]
    rl = build_rows(task, config, args.rl_train_size, args.test_size, seed=0, answer_extraction=extraction,
                    agent_name="tool_agent")
    # SFT questions come from another seed; the RL test split stays unseen by both trainers.
    sft = build_rows(task, config, args.sft_size, 0, seed=1, answer_extraction=extraction, agent_name="tool_agent")
    test_questions = {row["prompt"][0]["content"] for row in rl["test"]}
    system_prompt = hermes_tool_prompt([CalculatorTool().get_openai_tool_schema().to_dict()])
    sft_rows = [{"messages": demonstration(row["prompt"][0]["content"], system_prompt)}
                for row in sft["train"] if row["prompt"][0]["content"] not in test_questions]
    pd.DataFrame(rl["train"]).to_parquet(out / "train.parquet")
    pd.DataFrame(rl["test"]).to_parquet(out / "test.parquet")
    split = max(len(sft_rows) // 8, 1)
    pd.DataFrame(sft_rows[split:]).to_parquet(out / "sft_train.parquet")
    pd.DataFrame(sft_rows[:split]).to_parquet(out / "sft_val.parquet")
    print(f"wrote {len(rl['train'])} RL train, {len(rl['test'])} test, {len(sft_rows) - split} SFT train, "
          f"{split} SFT val rows to {out}")


if __name__ == "__main__":
    main()
