"""What the tool agent's held-out failures are: each wrong validation answer sorted by where it went wrong.

Reads a validation dump (`trainer.validation_data_dir`, one JSON line per sample: the prompt, the model's own tokens
of every turn with the tool's replies left out, the ground truth, the score) of the calculator agent
(`grpo_smollm2_calculator_agent`) and sorts each sample into:

- right: scored 1;
- no_call: the model never called the calculator;
- wrong_expression: the call's expression is not the question's (a digit, operator or order copied wrong), so the
  tool computed another number;
- wrong_transcription: the expression was the question's, so the tool returned the right value, but the final
  "Answer:" line differs from it;
- unparsed_call: a tool call the loop could not parse as JSON with an expression;
- other.

The question's expression is the text after "Calculate " up to the first ". "; the tool's value is recomputed
with the calculator's own evaluator. The table and per-category examples print; the counts go to
benchmarks/results/tool_agent_failures_<UTC>.json:

    python benchmarks/tool_agent_failures.py /tmp/tool_val_dump/15.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
QUESTION = re.compile(r"Calculate (.+?)\.\s")
ANSWER = re.compile(r"Answer:\s*(-?[\d,.]+)")


def normalised(expression: str) -> str:
    return re.sub(r"\s+", "", expression)


def classify(row: dict) -> tuple[str, dict]:
    """(category, details) of one validation sample."""
    from hybridflow.tools.calculator import evaluate_expression

    question = QUESTION.search(row["input"])
    expected_expression = question.group(1) if question else None
    calls = CALL.findall(row["output"])
    answers = ANSWER.findall(row["output"])
    final = answers[-1].replace(",", "") if answers else None
    details = {"expected_expression": expected_expression, "final": final, "truth": str(row["gts"])}
    if row["score"] >= 1:
        return "right", details
    if not calls:
        return ("no_call" if "<tool_call>" not in row["output"] else "unparsed_call"), details
    try:
        expression = json.loads(calls[-1])["arguments"]["expression"]
    except (ValueError, KeyError, TypeError):
        return "unparsed_call", details
    details["call"] = expression
    try:
        details["tool_value"] = str(evaluate_expression(expression))
    except Exception as error:  # noqa: BLE001 - the tool would have answered with this error
        details["tool_error"] = f"{type(error).__name__}: {error}"
    if expected_expression is not None and normalised(expression) != normalised(expected_expression):
        return "wrong_expression", details
    if final != details.get("tool_value"):
        return "wrong_transcription", details
    return "other", details


def main() -> None:
    from hybridflow.utils.host import write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump", type=Path)
    parser.add_argument("--examples", type=int, default=3)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    rows = [json.loads(line) for line in args.dump.read_text().splitlines()]
    sorted_rows = collections.defaultdict(list)
    for row in rows:
        category, details = classify(row)
        sorted_rows[category].append({**details, "output": row["output"][-300:]})
    print(f"{len(rows)} samples from {args.dump}")
    for category, items in sorted(sorted_rows.items(), key=lambda item: -len(item[1])):
        print(f"  {category:<20} {len(items):>4}  ({len(items) / len(rows):.1%})")
    for category, items in sorted_rows.items():
        if category == "right":
            continue
        print(f"\n{category}:")
        for item in items[: args.examples]:
            print("  ", {key: item[key] for key in item if key != "output"})
    path = write_results("tool_agent_failures", {"dump": str(args.dump), "samples": len(rows)},
                         [{"category": c, "count": len(items), "examples": items[:10]}
                          for c, items in sorted_rows.items()], load_before)
    print(f"\nraw rows: {path}")


if __name__ == "__main__":
    main()
