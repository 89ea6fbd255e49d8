"""Shared pieces of the preprocess scripts: the row layout, the output arguments, safe parquet writing."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["add_output_args", "check_outputs_free", "make_row", "read_json_records", "write_splits"]

logger = logging.getLogger(__name__)


def make_row(*, data_source: str, content: str, ability: str, ground_truth: Any,
             extra_info: dict[str, Any]) -> dict[str, Any]:
    """One parquet row in verl's schema, with a single user message as the prompt."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """--local_dir (where the parquet files go) and --overwrite."""
    parser.add_argument("--local_dir", required=True, help="directory to write the parquet files into")
    parser.add_argument("--overwrite", action="store_true", help="replace parquet files that already exist")


def check_outputs_free(local_dir: str | Path, split_names: Sequence[str], overwrite: bool) -> None:
    """Raise FileExistsError naming the path if `{local_dir}/{split}.parquet` exists and not `overwrite`.

    Scripts call this before any slow work, and `write_splits` again before writing.
    """
    if overwrite:
        return
    for split in split_names:
        path = Path(local_dir).expanduser() / f"{split}.parquet"
        if path.exists():
            raise FileExistsError(f"{path} already exists; pass --overwrite to replace it")


def write_splits(local_dir: str | Path, splits: Mapping[str, Sequence[dict[str, Any]]], overwrite: bool) -> list[Path]:
    """Write `{local_dir}/{split}.parquet` for each split; returns the paths.

    Raises:
        FileExistsError: a target file exists and `overwrite` is False (checked for every split before
            anything is written, and naming the path).
    """
    check_outputs_free(local_dir, list(splits), overwrite)
    directory = Path(local_dir).expanduser()
    paths = {split: directory / f"{split}.parquet" for split in splits}
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        if not rows:
            raise ValueError(f"split {split!r} has no rows; nothing to write to {paths[split]}")
        pq.write_table(pa.Table.from_pylist(list(rows)), paths[split])
        logger.info("wrote %d rows to %s", len(rows), paths[split])
    return list(paths.values())


def read_json_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) pairs from a .jsonl file, a .json file (an object or a list of them) or a
    directory of such files (searched recursively, in sorted order); `where` is 'file:line' for errors."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl"))
        if not files:
            raise FileNotFoundError(f"no .json or .jsonl files under {path}")
        for file in files:
            yield from read_json_records(file)
        return
    if not path.is_file():
        raise FileNotFoundError(f"input not found: {path}")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if line.strip():
                    yield f"{path}:{line_number}", json.loads(line)
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    records = data if isinstance(data, list) else [data]
    for position, record in enumerate(records):
        yield f"{path}[{position}]", record
