"""verl's data.custom_cls: a user's dataset class from a file reads the prompts (the trainer's loaders build it
with RLHFDataset's arguments); a missing class, a class that is no torch Dataset, or half the setting are refused
before Ray, naming the key."""

from __future__ import annotations

import pytest

from hybridflow.data import RLHFDataset
from hybridflow.data.dataset_class import rl_dataset_class
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.run import build_dataloaders
from tests.data.test_rl_dataset import make_row, write_parquet
from tests.helpers import grpo_overrides, nothing_started

CUSTOM = '''
from hybridflow.data import RLHFDataset


class ShoutingDataset(RLHFDataset):
    """Every prompt in capitals: the change shows in the tokens."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        item["shouted"] = True
        return item

    def _render(self, messages):
        return super()._render([{**m, "content": m["content"].upper()} for m in messages])


class NotADataset:
    pass


class DropsTheRewardColumns(RLHFDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        del item["reward_model"]
        return item


class Unpadded(RLHFDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        keep = item["attention_mask"].bool()
        return {**item, **{key: item[key][keep] for key in ("input_ids", "attention_mask", "position_ids")}}


class FloatIds(RLHFDataset):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        return {**item, "input_ids": item["input_ids"].float()}


class OwnSignature(RLHFDataset):
    def __init__(self, path):
        pass
'''


def test_a_custom_dataset_class_reads_the_prompts(tmp_path, smollm2_tokenizer):
    module = tmp_path / "my_data.py"
    module.write_text(CUSTOM)
    train = write_parquet(tmp_path / "train.parquet", [make_row(f"what is {i} + 1?", index=i) for i in range(4)])
    cfg = load_config([f"data.train_files={train}", "data.train_batch_size=2", f"data.custom_cls.path={module}",
                       "data.custom_cls.name=ShoutingDataset"])
    dataset_cls = rl_dataset_class(cfg.data)
    assert dataset_cls.__name__ == "ShoutingDataset" and issubclass(dataset_cls, RLHFDataset)
    loader, _ = build_dataloaders(cfg.data, smollm2_tokenizer)
    batch = next(iter(loader))
    text = smollm2_tokenizer.decode(batch["raw_prompt_ids"][0])
    assert "WHAT IS" in text and "what is" not in text and list(batch["shouted"]) == [True, True]
    assert rl_dataset_class(load_config([f"data.train_files={train}"]).data) is RLHFDataset


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["data.custom_cls.name=Missing"], "data.custom_cls.name='Missing' is not defined in"),
        (["data.custom_cls.name=NotADataset"], "must be a class deriving from torch.utils.data.Dataset"),
    ],
)
def test_a_wrong_custom_dataset_class_is_refused_before_ray(tmp_path, extra, words):
    module = tmp_path / "my_data.py"
    module.write_text(CUSTOM)
    line = [*grpo_overrides(write_parquet(tmp_path / "t.parquet", [make_row("x")] * 8)),
            f"data.custom_cls.path={module}", *extra]
    with nothing_started(), pytest.raises(ValueError, match=words):
        validate_config(load_config(line))


def test_half_a_custom_class_setting_is_refused():
    with pytest.raises(ValueError, match=r"data.custom_cls.name.*a custom dataset class needs both"):
        load_config(["data.custom_cls.path=/tmp/x.py"])


@pytest.mark.parametrize(("name", "error"), [
    ("DropsTheRewardColumns", r"item 0 of data.train_files has no 'reward_model', which the reward managers read"),
    ("Unpadded", r"'input_ids' has \d+ positions, but every prompt is left-padded to data.max_prompt_length=64"),
    ("FloatIds", r"'input_ids' is torch.float32; token ids and masks are integer tensors"),
    ("OwnSignature", r"could not be built as RLHFDataset is, with keywords data_files, tokenizer, config"),
])
def test_a_custom_dataset_whose_items_the_trainer_cannot_read_is_refused_when_built(tmp_path, smollm2_tokenizer,
                                                                                   name, error):
    """The loaders check the class's first and last items, before Ray: these failed after generation (a missing
    column in the reward stage) or as torch's stack error in the batch's collation."""
    module = tmp_path / "my_data.py"
    module.write_text(CUSTOM)
    train = write_parquet(tmp_path / "train.parquet", [make_row(f"what is {i} + 1?", index=i) for i in range(4)])
    cfg = load_config([f"data.train_files={train}", "data.train_batch_size=2", "data.max_prompt_length=64",
                       f"data.custom_cls.path={module}", f"data.custom_cls.name={name}"])
    with pytest.raises((TypeError, ValueError), match=rf"data.custom_cls.name='{name}'.*{error}"):
        build_dataloaders(cfg.data, smollm2_tokenizer)
