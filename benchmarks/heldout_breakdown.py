"""Where a held-out gain comes from: the per-problem marks of `hybridflow eval --json` grouped by the kind of
basic_arithmetic problem (its operators, and whether the result is negative).

The problems are drawn again from the file's task, config, seed and excluded parquets (the same draw as the
evaluation: `heldout_problems` is deterministic), so each mark meets its question. Per kind and record it prints
greedy accuracy (flexible extraction) and, when the file has sampled responses (`--samples`), pass@k at the largest
k: how often sampling finds the answer at all, which bounds what RL can sharpen into the greedy answer.

    python benchmarks/heldout_breakdown.py benchmarks/results/heldout_passk_AMD-EPYC_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from hybridflow.evaluation.heldout import compute_pass_at_k, excluded_questions, heldout_problems

TERM = re.compile(r"-?\d+|[-+*/]")


def problem_kind(question: str, answer: str) -> str:
    """'+', '-', '+ -', ... (the operators in order of first use) and ', negative' when the answer is below 0."""
    expression = question.removeprefix("Calculate ").rstrip(".")
    operators = [token for token in TERM.findall(expression) if token in "+-*/" and len(token) == 1]
    kind = " ".join(dict.fromkeys(operators)) or "none"
    try:
        negative = float(answer) < 0
    except ValueError:
        negative = False
    return kind + (", negative" if negative else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a `hybridflow eval --json` file")
    args = parser.parse_args()
    payload = json.loads(Path(args.results).read_text())
    records = payload["records"]
    problems, _ = heldout_problems(payload["task"], payload["task_config"], records[0]["num_problems"],
                                   payload["seed"], excluded_questions(payload["excluded"]))
    kinds = [problem_kind(p.question, p.answer) for p in problems]
    print(f"{payload['task']} {payload['task_config']}, {len(problems)} held-out problems (seed {payload['seed']})")
    header = "| kind | problems | " + " | ".join(
        f"{Path(r['model']).name or r['model']} ({r['prompt']}) greedy" + (
            f" / pass@{r['num_samples']}" if "sampled_correct" in r else "") for r in records) + " |"
    print(header)
    print("|---|---|" + "---|" * len(records))
    by_kind: dict[str, list[int]] = defaultdict(list)
    for index, kind in enumerate(kinds):
        by_kind[kind].append(index)
    for kind, indices in sorted(by_kind.items(), key=lambda item: -len(item[1])) + [("all", list(range(len(kinds))))]:
        cells = []
        for record in records:
            greedy = sum(record["correct"]["flexible"][i] for i in indices) / len(indices)
            cell = f"{100 * greedy:.1f}%"
            if "sampled_correct" in record:
                n = record["num_samples"]
                found = sum(compute_pass_at_k(n, record["sampled_correct"][i], n) for i in indices) / len(indices)
                cell += f" / {100 * found:.1f}%"
            cells.append(cell)
        print(f"| {kind} | {len(indices)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
