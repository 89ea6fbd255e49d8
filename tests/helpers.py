"""What many test modules share: parquet rows, a local tokenizer, the small GRPO command line, and the check that a
config error comes before anything starts. Test modules import from here, never from each other."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq

# A bound that only catches a config check that hangs or loads the whole runtime: the check is CPU-bound (Hydra's
# compose and OmegaConf copies, about 0.76 M Python calls), so its time follows the machine's load. Measured in-process
# on the 2-core AMD EPYC host at load average 11-17 (2026-11-27): 1.6-5.8 s per check, median 3.9 s, at most 11.4 s
# over 33 checks. What the tests mean by "fast" is `nothing_started`: no Ray and no model weights.
CONFIG_CHECK_BOUND_S = 60.0


def grpo_overrides(train_file: str, *extra: str) -> list[str]:
    """The small GRPO command line on 2 workers (a valid config for config checks), plus `extra`."""
    return [
        f"data.train_files=[{train_file}]", "data.train_batch_size=8", "data.max_prompt_length=64",
        "data.max_response_length=32", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=2", *extra,
    ]


def write_rows(path: Path, data_sources: list[str], **columns) -> str:
    """A parquet file with `data_source` and `prompt` columns (what config validation reads) and optional others."""
    prompts = [[{"role": "user", "content": f"question {index}"}] for index in range(len(data_sources))]
    pq.write_table(pa.table({"data_source": list(data_sources), "prompt": prompts, **columns}), path)
    return str(path)


def local_tokenizer():
    """The offline tokenizer that models and datasets tests share (built from files in the package)."""
    from hybridflow.models import build_local_tokenizer

    return build_local_tokenizer()


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a config check {what}: config errors must come before any worker starts")

    return refuse


@contextlib.contextmanager
def nothing_started() -> Iterator[None]:
    """The code inside neither starts Ray nor loads model weights ("before any worker starts"), and takes less than
    `CONFIG_CHECK_BOUND_S` (a generous bound against hangs; measured values are in its comment)."""
    import ray
    from transformers import PreTrainedModel

    with (
        mock.patch.object(ray, "init", _refuse("started Ray")),
        mock.patch.object(PreTrainedModel, "from_pretrained", _refuse("loaded model weights")),
    ):
        start = time.perf_counter()
        yield
    elapsed = time.perf_counter() - start
    assert elapsed < CONFIG_CHECK_BOUND_S, (
        f"a config check took {elapsed:.1f} s (1.6-5.8 s, at most 11.4 s, on the loaded 2-core AMD EPYC host): it "
        "loads more than validation needs"
    )


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) intervals that hold one instant (an end and a start at the same instant
    do not overlap)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most
