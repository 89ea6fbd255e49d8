"""A tiny model with a small local tokenizer and small SFT parquet files (single-turn and multi-turn)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

TOOL_CHAT = [
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "Let me compute it."},
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "12 + 7 = 19. Answer: 19"},
]


def single_turn_rows(count: int, offset: int = 0) -> list[dict]:
    rows = []
    for index in range(offset, offset + count):
        a, b = index % 10, (3 * index) % 10
        rows.append({"prompt": f"Calculate {a} + {b}.", "response": f"{a} + {b} = {a + b}. Answer: {a + b}"})
    return rows


@pytest.fixture(scope="package")
def sft_workspace(tmp_path_factory):
    from hybridflow.models import build_local_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("sft")
    save_tiny_model(root / "tiny", tokenizer=build_local_tokenizer(), seed=0)
    pq.write_table(pa.Table.from_pylist(single_turn_rows(16)), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(single_turn_rows(6, offset=100)), root / "val.parquet")
    multiturn = [{"messages": TOOL_CHAT[: 2 + 2 * (index % 2)]} for index in range(8)]
    pq.write_table(pa.Table.from_pylist(multiturn), root / "chat.parquet")
    return root


def sft_overrides(root, run_dir, *extra: str) -> list[str]:
    return [
        f"data.train_files=[{root / 'train.parquet'}]",
        f"data.val_files=[{root / 'val.parquet'}]",
        f"model.partial_pretrain={root / 'tiny'}",
        "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=2",
        "data.max_length=64",
        "optim.lr=1e-2",
        "optim.warmup_steps_ratio=0",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]
