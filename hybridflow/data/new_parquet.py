"""Writing a parquet file that must not exist yet: staged beside its target and renamed when complete, so an
interrupted write leaves no partial file and nothing a user saved is written over."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hybridflow.data.config import expand_path

__all__ = ["write_new_parquet"]


def write_new_parquet(frame: Any, output_path: str, key: str) -> Path:
    """Write the pandas `frame` to `output_path` (`~` expanded, parent folders made); returns the resolved path.

    Raises:
        FileExistsError: the file appeared while the job ran (checked before it started too); `key` names the
            setting, and nothing is written over.
    """
    target = expand_path(output_path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
    frame.to_parquet(staging)
    if target.exists():
        staging.unlink()
        raise FileExistsError(f"{key}={output_path!r} appeared while the job ran; the results were not written over "
                              "it: choose another path")
    staging.rename(target)
    return target
