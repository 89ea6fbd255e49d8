"""Which dataset class reads the RL prompts: hybridflow's `RLHFDataset`, or a user's from `data.custom_cls`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.data.config import RLHFDataConfig


def rl_dataset_class(config: RLHFDataConfig) -> type:
    """`data.custom_cls.name` from the file `data.custom_cls.path`, checked to be a torch Dataset; `RLHFDataset`
    when none is set. Errors name the key (the file, the class, what it must be)."""
    from torch.utils.data import Dataset

    from hybridflow.data.rl_dataset import RLHFDataset
    from hybridflow.utils.file_module import import_file

    custom = config.custom_cls
    if custom.path is None:
        return RLHFDataset
    path = str(Path(custom.path).expanduser().resolve())
    module = import_file(path, "hybridflow_custom_dataset_", "data.custom_cls.path")
    dataset_cls = getattr(module, custom.name, None)
    if dataset_cls is None:
        raise AttributeError(f"data.custom_cls.name={custom.name!r} is not defined in {path}")
    if not (isinstance(dataset_cls, type) and issubclass(dataset_cls, Dataset)):
        raise TypeError(
            f"data.custom_cls.name={custom.name!r} in {path} must be a class deriving from torch.utils.data.Dataset "
            "(subclass hybridflow.data.RLHFDataset to change how rows become prompts)"
        )
    return dataset_cls


def build_custom_dataset(dataset_cls: type, files: list[str], tokenizer: Any, config: RLHFDataConfig,
                         max_samples: int, processor: Any, key: str) -> Any:
    """`data.custom_cls` built on `files` (`key` names them), its first and last items checked against what the
    trainer reads (`check_custom_items`): a mistake fails here, before Ray, naming the class, instead of as a
    torch error in the batch's collation or a missing column in the reward stage after generation."""
    name = f"data.custom_cls.name={config.custom_cls.name!r}"
    try:
        dataset = dataset_cls(data_files=files, tokenizer=tokenizer, config=config, max_samples=max_samples,
                              processor=processor)
    except TypeError as err:
        raise TypeError(f"{name} could not be built as RLHFDataset is, with keywords data_files, tokenizer, config, "
                        f"max_samples and processor: {err}; give its __init__ those parameters (subclass "
                        "hybridflow.data.RLHFDataset to keep them)") from err
    check_custom_items(dataset, config, name, key)
    return dataset


def check_custom_items(dataset: Any, config: RLHFDataConfig, name: str, key: str) -> None:
    """The items the trainer collates: a dict with integer `input_ids` and `attention_mask` (and `position_ids`)
    tensors left-padded to `data.max_prompt_length`, the `data.reward_fn_key` column and `reward_model` (a dict
    with 'ground_truth') the reward managers read."""
    import torch

    size = len(dataset)
    if size == 0:
        raise ValueError(f"{name} holds no items for {key}")
    for index in sorted({0, size - 1}):
        where = f"{name}: item {index} of {key}"
        item = dataset[index]
        if not isinstance(item, dict):
            raise TypeError(f"{where} is a {type(item).__name__}; items are dicts (see RLHFDataset.__getitem__)")
        for column in ("input_ids", "attention_mask", "position_ids"):
            value = item.get(column)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{where} has no {column!r} tensor (keys: {sorted(item)})")
            if value.shape[-1] != config.max_prompt_length:
                raise ValueError(f"{where}: {column!r} has {value.shape[-1]} positions, but every prompt is "
                                 f"left-padded to data.max_prompt_length={config.max_prompt_length} so that a batch "
                                 "stacks; pad it (RLHFDataset does)")
            if column != "position_ids" and (value.dtype.is_floating_point or value.dtype.is_complex):
                raise ValueError(f"{where}: {column!r} is {value.dtype}; token ids and masks are integer tensors")
        for column in (config.reward_fn_key, "reward_model"):
            if column not in item:
                raise ValueError(f"{where} has no {column!r}, which the reward managers read (keys: {sorted(item)}); "
                                 "keep the row's column in the item")
        reward = item["reward_model"]
        if not (isinstance(reward, dict) and "ground_truth" in reward):
            raise ValueError(f"{where}: 'reward_model' must be a dict with 'ground_truth', got {reward!r:.100}")
