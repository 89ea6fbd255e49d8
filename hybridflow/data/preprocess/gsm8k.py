"""Write GSM8K as parquet from local jsonl files (GSM8K's public format) or, with internet, from the Hub.

    python -m hybridflow.data.preprocess.gsm8k --input grade_school_math/data --local_dir ~/data/gsm8k
    python -m hybridflow.data.preprocess.gsm8k --input test.jsonl --split test --local_dir ~/data/gsm8k
    python -m hybridflow.data.preprocess.gsm8k --hf --local_dir ~/data/gsm8k       # needs `datasets`

Input records have `question` and `answer`, the answer ending in `#### N`. --input is a .jsonl file
(its split from --split, else from the file name train/test) or a directory holding train.jsonl and/or
test.jsonl. Rows: data_source `openai/gsm8k`, the question plus verl's instruction to answer after
"####", `reward_model.ground_truth` = N (commas removed).

--multiturn_tool writes verl's `gsm8k_multiturn_w_tool` rows instead, for the tool agent with the `gsm8k_answer`
tool (`calc_gsm8k_reward`): verl's system prompt asking for the tool before the final answer, and per row
`extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth` and `interaction_kwargs` (query, ground_truth).
--multiturn_interaction writes verl's `gsm8k_multiturn_w_interaction` rows, for the tool agent with the `gsm8k`
interaction: verl's system prompt asking to rethink when told the answer is wrong, and `interaction_kwargs` (name
gsm8k, query, ground_truth).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.data.preprocess.common import (
    add_output_args, check_outputs_free, make_row, read_json_records, write_splits)

__all__ = ["DATA_SOURCE", "INSTRUCTION", "INTERACTION_SYSTEM_PROMPT", "LAYOUTS", "TOOL_SYSTEM_PROMPT", "build_rows",
           "extract_answer", "main"]

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by step "
    "before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. Put your final answer in the "
    "format of `#### <answer>`."
)
"""verl's `gsm8k_multiturn_w_tool` prompt (examples/data_preprocess), word for word."""
INTERACTION_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. You should rethinking "
    "carefully if user point out your answer is wrong. Put your final answer in the format of `#### <answer>`."
)
"""verl's `gsm8k_multiturn_w_interaction` prompt, word for word."""
LAYOUTS = ("single_turn", "multiturn_tool", "multiturn_interaction")


def extract_answer(answer: str, where: str) -> str:
    """'... #### 1,234' -> '1234'; ValueError naming `where` if there is no '####'."""
    if "####" not in answer:
        raise ValueError(f"{where}: field 'answer' has no '#### <number>' final answer")
    return answer.split("####")[-1].strip().replace(",", "")


def build_rows(
    records: Iterable[tuple[str, dict[str, Any]]], split: str, layout: str = "single_turn"
) -> list[dict[str, Any]]:
    """Parquet rows from (where, {'question', 'answer'}) records, in one of `LAYOUTS` (module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    rows = []
    for index, (where, record) in enumerate(records):
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: field {key!r} is missing")
        solution = extract_answer(record["answer"], where)
        extra_info = {"split": split, "index": index, "question": record["question"], "answer": record["answer"]}
        if layout == "single_turn":
            rows.append(make_row(data_source=DATA_SOURCE, content=f"{record['question']} {INSTRUCTION}",
                                 ability="math", ground_truth=solution, extra_info=extra_info))
            continue
        question = f"{record['question']} {TOOL_INSTRUCTION}"
        if layout == "multiturn_tool":
            system = TOOL_SYSTEM_PROMPT
            extra_info.update(need_tools_kwargs=True,
                              tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
                              interaction_kwargs={"query": question, "ground_truth": solution})
        else:
            system = INTERACTION_SYSTEM_PROMPT
            extra_info["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": solution}
        row = make_row(data_source=DATA_SOURCE, content=question, ability="math", ground_truth=solution,
                       extra_info=extra_info)
        row["prompt"].insert(0, {"role": "system", "content": system})
        rows.append(row)
    return rows


def _local_inputs(path: Path, split: str | None) -> dict[str, Path]:
    if path.is_dir():
        found = {name: path / f"{name}.jsonl" for name in ("train", "test") if (path / f"{name}.jsonl").is_file()}
        if not found:
            raise FileNotFoundError(f"no train.jsonl or test.jsonl in {path}")
        return found
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    split = split or (path.stem if path.stem in ("train", "test") else None)
    if split is None:
        raise ValueError(f"cannot tell the split of {path}; pass --split train or --split test")
    return {split: path}


def _hub_records(split: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("--hf needs the `datasets` package (pip install datasets); "
                          "offline, pass --input with GSM8K's jsonl files") from err
    rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
    return [(f"openai/gsm8k[{split}][{i}]", dict(row)) for i, row in enumerate(rows)]


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a GSM8K .jsonl file, or a directory with train.jsonl/test.jsonl")
    source.add_argument("--hf", action="store_true", help="download openai/gsm8k with `datasets`")
    parser.add_argument("--split", choices=("train", "test"), help="split of a single --input file")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--multiturn_tool", dest="layout", action="store_const", const="multiturn_tool",
                        help="verl's gsm8k_multiturn_w_tool rows, for the tool agent and its gsm8k_answer tool")
    layout.add_argument("--multiturn_interaction", dest="layout", action="store_const", const="multiturn_interaction",
                        help="verl's gsm8k_multiturn_w_interaction rows, for the tool agent and the gsm8k interaction")
    parser.set_defaults(layout="single_turn")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.hf:
        splits = [args.split] if args.split else ["train", "test"]
        check_outputs_free(args.local_dir, splits, args.overwrite)
        out = {split: build_rows(_hub_records(split), split, args.layout) for split in splits}
    else:
        inputs = _local_inputs(Path(args.input).expanduser(), args.split)
        check_outputs_free(args.local_dir, list(inputs), args.overwrite)
        out = {split: build_rows(read_json_records(path), split, args.layout) for split, path in inputs.items()}
    write_splits(args.local_dir, out, args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
