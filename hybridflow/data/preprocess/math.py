"""Write MATH (Hendrycks et al.) as parquet from local files in its public formats or, with internet, the Hub.

    python -m hybridflow.data.preprocess.math --input MATH/test --local_dir ~/data/math --split test
    python -m hybridflow.data.preprocess.math --input math500.jsonl --split test --local_dir ~/data/math500
    python -m hybridflow.data.preprocess.math --hf --local_dir ~/data/math          # needs `datasets`

--input is a .jsonl file, a .json file (one problem or a list) or a directory of them (the original
release: one .json per problem). Records have `problem` and `solution`, whose last `\\boxed{}` is the
ground truth (a record without one may give `answer`). Rows: data_source
`DigitalLearningGmbH/MATH-lighteval` (verl's), the problem plus an instruction to box the final answer.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.data.preprocess.common import (
    add_output_args, check_outputs_free, make_row, read_json_records, write_splits)
from hybridflow.rewards.score.math import last_boxed_only_string, remove_boxed

__all__ = ["DATA_SOURCE", "INSTRUCTION", "build_rows", "main"]

logger = logging.getLogger(__name__)

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _ground_truth(record: dict[str, Any], where: str) -> str:
    boxed = last_boxed_only_string(record["solution"])
    if boxed is not None:
        return remove_boxed(boxed)
    if isinstance(record.get("answer"), str) and record["answer"].strip():
        return record["answer"].strip()
    raise ValueError(f"{where}: field 'solution' has no \\boxed{{}} answer and there is no 'answer' field")


def build_rows(records: Iterable[tuple[str, dict[str, Any]]], split: str) -> list[dict[str, Any]]:
    """Parquet rows from (where, {'problem', 'solution', ...}) records."""
    rows = []
    for index, (where, record) in enumerate(records):
        for key in ("problem", "solution"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: field {key!r} is missing")
        rows.append(make_row(
            data_source=DATA_SOURCE,
            content=f"{record['problem']} {INSTRUCTION}",
            ability="math",
            ground_truth=_ground_truth(record, where),
            extra_info={"split": split, "index": index, "level": str(record.get("level", "")),
                        "type": str(record.get("type", record.get("subject", "")))},
        ))
    return rows


def _hub_records(split: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("--hf needs the `datasets` package (pip install datasets); "
                          "offline, pass --input with MATH's json/jsonl files") from err
    rows = datasets.load_dataset(DATA_SOURCE, split=split)
    return [(f"{DATA_SOURCE}[{split}][{i}]", dict(row)) for i, row in enumerate(rows)]


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a MATH .jsonl/.json file or a directory of them")
    source.add_argument("--hf", action="store_true", help=f"download {DATA_SOURCE} with `datasets`")
    parser.add_argument("--split", choices=("train", "test"), help="output split (required with --input)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    if args.hf:
        splits = [args.split] if args.split else ["train", "test"]
        check_outputs_free(args.local_dir, splits, args.overwrite)
        out = {split: build_rows(_hub_records(split), split) for split in splits}
    else:
        if args.split is None:
            raise ValueError("--input needs --split train or --split test")
        check_outputs_free(args.local_dir, [args.split], args.overwrite)
        out = {args.split: build_rows(read_json_records(Path(args.input).expanduser()), args.split)}
    write_splits(args.local_dir, out, args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
