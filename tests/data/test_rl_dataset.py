"""RLHFDataset and collate_fn on small parquet files written here, with SmolLM2's tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import RLHFDataConfig, RLHFDataset, collate_fn
from hybridflow.protocol import DataProto
from hybridflow.utils.config import ConfigFieldError, build_config

SHORT = "What is 2+2?"
LONG = "Please add these numbers carefully: " + " + ".join(str(n) for n in range(40)) + "."


def make_row(content: str, *, index: int = 0, extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(index)},
        "extra_info": extra_info if extra_info is not None else {"split": "train", "index": index},
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def prompt_ids(tokenizer: Any, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def three_rows(tmp_path: Path) -> Path:
    return write_parquet(tmp_path / "train.parquet",
                         [make_row(SHORT, index=10), make_row("What is 3+5?", index=11), make_row(LONG, index=12)])


def test_item_is_left_padded_with_verl_fields(three_rows: Path, smollm2_tokenizer: Any) -> None:
    config = RLHFDataConfig(max_prompt_length=200, filter_overlong_prompts=False, truncation="error",
                            return_raw_chat=True)
    dataset = RLHFDataset(three_rows, smollm2_tokenizer, config)
    assert len(dataset) == 3
    item = dataset[0]
    ids = prompt_ids(smollm2_tokenizer, SHORT)
    n = len(ids)
    assert item["input_ids"].shape == item["attention_mask"].shape == item["position_ids"].shape == (200,)
    assert item["input_ids"].dtype == torch.long
    pad = smollm2_tokenizer.pad_token_id
    assert item["input_ids"][: 200 - n].eq(pad).all()
    assert item["input_ids"][200 - n:].tolist() == ids
    assert item["attention_mask"].tolist() == [0] * (200 - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (200 - n) + list(range(n))
    assert item["raw_prompt_ids"] == ids
    assert item["data_source"] == "openai/gsm8k"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "10"}
    assert item["extra_info"] == {"split": "train", "index": 10}
    assert item["index"] == 10
    assert item["raw_prompt"] == [{"role": "user", "content": SHORT}]
    assert item["tools_kwargs"] == {} and item["interaction_kwargs"] == {}
    assert "prompt" not in item and "agent_name" not in item


def test_collate_feeds_dataproto(three_rows: Path, smollm2_tokenizer: Any) -> None:
    config = RLHFDataConfig(max_prompt_length=200, filter_overlong_prompts=False)
    dataset = RLHFDataset(three_rows, smollm2_tokenizer, config)
    batch = collate_fn([dataset[0], dataset[1], dataset[2]])
    assert batch["input_ids"].shape == (3, 200)
    assert batch["raw_prompt_ids"].dtype == object and batch["raw_prompt_ids"].shape == (3,)
    data = DataProto.from_single_dict(batch)
    assert len(data) == 3
    assert data.batch["attention_mask"].shape == (3, 200)
    assert list(data.non_tensor_batch["index"]) == [10, 11, 12]
    assert data.non_tensor_batch["reward_model"][2]["ground_truth"] == "12"
    assert isinstance(data.non_tensor_batch["raw_prompt_ids"][0], list)


def test_collate_keeps_equal_length_lists_as_objects() -> None:
    items = [{"x": torch.zeros(2), "ids": [1, 2]}, {"x": torch.ones(2), "ids": [3, 4]}]
    batch = collate_fn(items)
    assert batch["ids"].shape == (2,) and batch["ids"][1] == [3, 4]
    with pytest.raises(ValueError, match="item 1 has keys"):
        collate_fn([{"x": torch.zeros(1)}, {"y": torch.zeros(1)}])


def test_overlong_prompts_are_filtered_with_one_warning(three_rows: Path, smollm2_tokenizer: Any,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    short_len = len(prompt_ids(smollm2_tokenizer, "What is 3+5?"))
    long_len = len(prompt_ids(smollm2_tokenizer, LONG))
    assert short_len < long_len
    config = RLHFDataConfig(max_prompt_length=short_len, filter_overlong_prompts=True)
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.rl_dataset"):
        dataset = RLHFDataset(three_rows, smollm2_tokenizer, config)
    assert len(dataset) == 2
    assert [dataset[i]["index"] for i in range(2)] == [10, 11]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "filtered 1 of 3" in warnings[0].getMessage()


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(three_rows: Path, smollm2_tokenizer: Any, mode: str) -> None:
    config = RLHFDataConfig(max_prompt_length=16, filter_overlong_prompts=False, truncation=mode)
    dataset = RLHFDataset(three_rows, smollm2_tokenizer, config)
    full = prompt_ids(smollm2_tokenizer, LONG)
    item = dataset[2]
    expected = {"left": full[-16:], "right": full[:16], "middle": full[:8] + full[-8:]}[mode]
    assert item["input_ids"].tolist() == expected
    assert item["raw_prompt_ids"] == expected
    assert item["attention_mask"].sum().item() == 16


def test_truncation_error_names_the_row(three_rows: Path, smollm2_tokenizer: Any) -> None:
    config = RLHFDataConfig(max_prompt_length=40, filter_overlong_prompts=False, truncation="error")
    with pytest.raises(ValueError, match=r"train\.parquet: row 2: prompt has \d+ tokens > data\.max_prompt_length=40"):
        RLHFDataset(three_rows, smollm2_tokenizer, config)


class NoTokenizing:
    """Proves validation runs before any tokenization: every tokenizer call fails the test."""

    pad_token_id = 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise AssertionError("tokenized before the rows were validated")

    __call__ = apply_chat_template


@pytest.mark.parametrize(("broken", "field"), [
    ({"prompt": None}, "'prompt' is missing"),
    ({"prompt": [{"role": "user", "content": None}]}, r"'prompt'\[0\] must be a dict with str 'role' and 'content'"),
    ({"data_source": None}, "'data_source' is missing"),
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "'reward_model.ground_truth' is missing"),
])
def test_malformed_rows_name_file_row_and_field(tmp_path: Path, broken: dict[str, Any], field: str) -> None:
    rows = [make_row(SHORT), {**make_row(SHORT), **broken}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=rf"bad\.parquet: row 1: field {field}"):
        RLHFDataset(path, NoTokenizing(), RLHFDataConfig(max_prompt_length=8))


def test_prompt_that_is_not_a_list_is_rejected(tmp_path: Path) -> None:
    row = {**make_row(SHORT), "prompt": "just a string"}
    path = write_parquet(tmp_path / "str.parquet", [row])
    with pytest.raises(ValueError, match=r"str\.parquet: row 0: field 'prompt' must be a non-empty list"):
        RLHFDataset(path, NoTokenizing(), RLHFDataConfig(max_prompt_length=8))


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLHFDataset([missing], NoTokenizing(), RLHFDataConfig())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_prompt_length": 0}, r"^max_prompt_length=0 must be > 0"),
    ({"max_response_length": -1}, r"^max_response_length=-1 must be > 0"),
    ({"prompt_key": ""}, r"^prompt_key must name a column"),
    ({"train_max_samples": 0}, r"^train_max_samples"),
    ({"val_max_samples": -2}, r"^val_max_samples=-2 must be >= -1"),
    ({"apply_chat_template_kwargs": {"tokenize": True}}, r"^apply_chat_template_kwargs may not set \['tokenize'\]"),
])
def test_config_validation_names_the_field(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigFieldError, match=match):
        RLHFDataConfig(**kwargs)


def test_config_built_from_values_checks_choices_and_names_the_key() -> None:
    """The trainer builds `data.*` with build_config, which checks Literal fields such as truncation."""
    assert build_config(RLHFDataConfig, {"truncation": "middle", "train_files": "a.parquet"}, "data") == RLHFDataConfig(
        truncation="middle", train_files=["a.parquet"]
    )
    choices = r"\['error', 'left', 'right', 'middle'\]"
    with pytest.raises(ValueError, match=rf"^data\.truncation='sideways' is not one of {choices}"):
        build_config(RLHFDataConfig, {"truncation": "sideways"}, "data")
    with pytest.raises(ValueError, match=r"^data\.max_prompt_length=0 must be > 0"):
        build_config(RLHFDataConfig, {"max_prompt_length": 0}, "data")


def test_max_samples_keeps_the_first_rows_before_filtering(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    rows = [make_row(SHORT, index=0), make_row(LONG, index=1), make_row("What is 3+5?", index=2)]
    path = write_parquet(tmp_path / "train.parquet", rows)
    config = RLHFDataConfig(max_prompt_length=64, filter_overlong_prompts=False, truncation="left")
    assert [item["index"] for item in RLHFDataset(path, smollm2_tokenizer, config, max_samples=2)] == [0, 1]
    assert len(RLHFDataset(path, smollm2_tokenizer, config)) == 3
    assert len(RLHFDataset(path, smollm2_tokenizer, config, max_samples=10)) == 3
    # the limit counts rows as read: the over-long row 1 is one of the two, then filtered out
    filtering = RLHFDataConfig(max_prompt_length=len(prompt_ids(smollm2_tokenizer, SHORT)) + 4)
    assert [item["index"] for item in RLHFDataset(path, smollm2_tokenizer, filtering, max_samples=2)] == [0]


def test_agent_name_and_multiple_files(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    tool_row = make_row(SHORT, extra_info={"index": 0, "agent_name": "tool_agent"})
    first = write_parquet(tmp_path / "a.parquet", [tool_row])
    second = write_parquet(tmp_path / "b.parquet", [make_row(SHORT, extra_info={"index": 1})])
    dataset = RLHFDataset([first, second], smollm2_tokenizer, RLHFDataConfig(max_prompt_length=64))
    batch = collate_fn([dataset[0], dataset[1]])
    assert list(batch["agent_name"]) == ["tool_agent", None]
    assert isinstance(batch["agent_name"], np.ndarray)


def test_reads_reasoning_gym_preprocess_output(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    pytest.importorskip("reasoning_gym")
    from hybridflow.data.preprocess import reasoning_gym as rg_script

    rg_script.main(["--preset", "smollm2_easy", "--local_dir", str(tmp_path), "--train_size", "4", "--test_size", "2"])
    dataset = RLHFDataset(tmp_path / "train.parquet", smollm2_tokenizer, RLHFDataConfig(max_prompt_length=128))
    data = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    assert len(data) == 4
    assert set(data.non_tensor_batch["data_source"]) == {"reasoning_gym/basic_arithmetic"}


def test_arithmetic_rows_without_reasoning_gym_load(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    """The GPU tests' fallback rows (written without reasoning-gym) pass the dataset's row checks."""
    from tests.tiny_runs import write_arithmetic_rows

    write_arithmetic_rows(tmp_path, train_size=5, test_size=2, seed=0)
    config = build_config(RLHFDataConfig, {"max_prompt_length": 64})
    train = RLHFDataset(tmp_path / "train.parquet", smollm2_tokenizer, config)
    assert len(train) == 5 and len(RLHFDataset(tmp_path / "test.parquet", smollm2_tokenizer, config)) == 2
    item = train[3]
    assert item["index"] == 3 and item["input_ids"].shape == (64,)
    assert item["reward_model"]["ground_truth"].isdigit()
