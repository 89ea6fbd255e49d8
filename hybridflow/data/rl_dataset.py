"""`RLHFDataset`: parquet prompt rows in verl's schema -> left-padded prompt tensors; and `collate_fn`.

A row holds `prompt` (chat messages [{role, content}, ...]), `data_source` (str, picks the reward scorer),
`ability`, `reward_model` ({ground_truth, style}) and `extra_info` (dict: index, split, optionally
`agent_name`, `tools_kwargs`, `interaction_kwargs`). Every row is checked when the dataset is built, before
any tokenization, so a malformed file fails in seconds with the file, the row and the field.

With a vision-language model's processor, rows also hold images (`data.image_key`, `<image>` placeholders in
the prompt; see `hybridflow.data.multimodal`) and items carry verl's `multi_modal_data` / `multi_modal_inputs`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from hybridflow.data.config import RLHFDataConfig, expand_path
from hybridflow.data.multimodal import check_vision_row, encode_vision_prompt, vision_prompt_length
from hybridflow.data.prompt_lengths import chat_prompt_lengths, render_chat_prompt

__all__ = ["RLHFDataset", "collate_fn", "compute_position_ids"]

logger = logging.getLogger(__name__)



def compute_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask: (..., seq_len) 0/1 -> position ids (..., seq_len): 0 on left padding, then 0, 1, 2, ..."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


class RLHFDataset(Dataset):
    """Prompts for RL rollouts, read from one or more parquet files in verl's schema.

    Args:
        data_files: a parquet path or a list of them; rows are concatenated in order.
        tokenizer: a Hugging Face tokenizer with a chat template.
        config: the `data.*` section (`RLHFDataConfig`).
        max_samples: keep only the first this many rows (-1: all), before length filtering.
        processor: a vision-language model's `VisionProcessor` (`hybridflow.models.vision.load_processor`); None
            for text models, whose rows must hold no images.

    Each item is a dict:
        input_ids, attention_mask, position_ids: (max_prompt_length,) int64, left-padded;
        raw_prompt_ids: list[int], the prompt tokens without padding (after truncation);
        data_source, ability, reward_model, extra_info and any other parquet columns, unchanged;
        index: `extra_info['index']` if present, else the row's position in the dataset;
        tools_kwargs, interaction_kwargs: from `extra_info` (default {});
        agent_name: only when some row sets it (top-level column or `extra_info`); rows without one get None;
        raw_prompt: the chat messages, only with `config.return_raw_chat`.
        With a processor: position_ids is (4, max_prompt_length) (text positions, then M-RoPE's temporal, height
        and width rows), raw_prompt_ids has one image token per image (not expanded), multi_modal_data is
        {"image": [PIL images]} and multi_modal_inputs {"pixel_values", "image_grid_thw"}; the image column is
        left out.

    Raises:
        FileNotFoundError: a file does not exist (names the path).
        ValueError: a malformed row (names the file, the row index and the field), or with
            `truncation='error'` and no filtering, a prompt longer than `max_prompt_length`.
    """

    def __init__(self, data_files: str | os.PathLike | Sequence[str | os.PathLike], tokenizer: Any,
                 config: RLHFDataConfig, max_samples: int = -1, processor: Any = None) -> None:
        if not isinstance(config, RLHFDataConfig):
            raise TypeError(f"config must be an RLHFDataConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.data_files = _as_paths(data_files)
        self.pad_token_id = _resolve_pad_token_id(tokenizer)
        self._rows: list[dict[str, Any]] = []
        self._origins: list[tuple[str, int]] = []  # (file, row index in that file) for error messages
        for path in self.data_files:
            rows = pq.read_table(path).to_pylist()
            for row_index, row in enumerate(rows):
                _validate_row(row, str(path), row_index, config.prompt_key)
                check_vision_row(row, f"{path}: row {row_index}", prompt_key=config.prompt_key,
                                 image_key=config.image_key, video_key=config.video_key,
                                 has_processor=processor is not None)
                self._rows.append(row)
                self._origins.append((str(path), row_index))
        if max_samples > 0:
            self._rows, self._origins = self._rows[:max_samples], self._origins[:max_samples]
        self._has_agent_name = any(_agent_name(row) is not None for row in self._rows)
        if config.filter_overlong_prompts or config.truncation == "error":
            self._check_lengths()

    # ------------------------------------------------------------------ building
    def _render(self, messages: list[dict[str, Any]]) -> str:
        return render_chat_prompt(self.tokenizer, _clean_messages(messages), self.config.apply_chat_template_kwargs)

    def _check_lengths(self) -> None:
        """Filter (or, with truncation='error', reject) prompts longer than max_prompt_length."""
        max_len = self.config.max_prompt_length
        lengths = self._prompt_lengths()
        keep = [i for i, n in enumerate(lengths) if n <= max_len]
        if len(keep) == len(self._rows):
            return
        if not self.config.filter_overlong_prompts:
            first = next(i for i, n in enumerate(lengths) if n > max_len)
            path, row_index = self._origins[first]
            raise ValueError(
                f"{path}: row {row_index}: prompt has {lengths[first]} tokens > data.max_prompt_length={max_len}; "
                "set data.filter_overlong_prompts=True, data.truncation to 'left'/'right'/'middle', "
                "or raise data.max_prompt_length"
            )
        num_dropped = len(self._rows) - len(keep)
        logger.warning(
            "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens "
            "(data.filter_overlong_prompts=True)",
            num_dropped, len(self._rows), max_len,
        )
        self._rows = [self._rows[i] for i in keep]
        self._origins = [self._origins[i] for i in keep]
        if not self._rows:
            raise ValueError(
                f"every prompt in {[str(p) for p in self.data_files]} is longer than "
                f"data.max_prompt_length={max_len}; raise it"
            )

    def _prompt_lengths(self) -> list[int]:
        """Tokens of each row's prompt (with a processor: image tokens expanded)."""
        if self.processor is not None:
            return [self._vision_prompt_length(index) for index in range(len(self._rows))]
        conversations = [_clean_messages(row[self.config.prompt_key]) for row in self._rows]
        return chat_prompt_lengths(self.tokenizer, conversations, dict(self.config.apply_chat_template_kwargs),
                                   self.config.filter_overlong_prompts_workers)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self._rows[index]
        messages = row[self.config.prompt_key]
        if self.processor is not None:
            item = self._vision_item(index)
        else:
            ids = self.tokenizer(self._render(messages), add_special_tokens=False)["input_ids"]
            ids = self._truncate(list(ids), index)
            input_ids, attention_mask = _left_pad(ids, self.config.max_prompt_length, self.pad_token_id)
            item = {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": compute_position_ids(attention_mask),
                "raw_prompt_ids": ids,
            }
        for key, value in row.items():
            if key not in (self.config.prompt_key, self.config.image_key, self.config.video_key):
                item[key] = value
        extra_info = row.get("extra_info") or {}
        item["index"] = extra_info.get("index", index) if isinstance(extra_info, dict) else index
        item["tools_kwargs"] = _dict_or_empty(extra_info, "tools_kwargs")
        item["interaction_kwargs"] = _dict_or_empty(extra_info, "interaction_kwargs")
        if self._has_agent_name:
            item["agent_name"] = _agent_name(row)
        if self.config.return_raw_chat:
            item["raw_prompt"] = _clean_messages(messages)
        return item

    def _vision_item(self, index: int) -> dict[str, Any]:
        """Prompt tensors, M-RoPE positions and multi-modal fields of row `index` (`encode_vision_prompt`)."""
        row, (path, row_index) = self._rows[index], self._origins[index]
        return encode_vision_prompt(
            self.processor, row[self.config.prompt_key], row[self.config.image_key],
            max_length=self.config.max_prompt_length, pad_token_id=self.pad_token_id,
            where=f"{path}: row {row_index}", chat_template_kwargs=self.config.apply_chat_template_kwargs,
        )

    def _vision_prompt_length(self, index: int) -> int:
        row, (path, row_index) = self._rows[index], self._origins[index]
        return vision_prompt_length(
            self.processor, row[self.config.prompt_key], row[self.config.image_key], f"{path}: row {row_index}",
            self.config.apply_chat_template_kwargs,
        )

    def _truncate(self, ids: list[int], index: int) -> list[int]:
        max_len = self.config.max_prompt_length
        if len(ids) <= max_len:
            return ids
        mode = self.config.truncation
        if mode == "left":
            return ids[-max_len:]
        if mode == "right":
            return ids[:max_len]
        if mode == "middle":
            head = max_len // 2
            return ids[:head] + ids[len(ids) - (max_len - head):]
        path, row_index = self._origins[index]
        raise ValueError(
            f"{path}: row {row_index}: prompt has {len(ids)} tokens > data.max_prompt_length={max_len} "
            "and data.truncation='error'"
        )


def collate_fn(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack dataset items: tensors -> (bs, ...) tensors, everything else -> (bs,) numpy object arrays.

    The result goes straight into `DataProto.from_single_dict`.
    """
    if not items:
        raise ValueError("collate_fn got an empty list of items")
    keys = list(items[0])
    for position, item in enumerate(items):
        if set(item) != set(keys):
            raise ValueError(
                f"collate_fn: item {position} has keys {sorted(item)} but item 0 has {sorted(keys)}"
            )
    out: dict[str, Any] = {}
    for key in keys:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values, dim=0)
        else:
            array = np.empty(len(values), dtype=object)
            for position, value in enumerate(values):  # element-wise: equal-length lists must stay objects
                array[position] = value
            out[key] = array
    return out


# ---------------------------------------------------------------------- helpers
def _as_paths(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(data_files, (str, os.PathLike)):
        data_files = [data_files]
    paths = [expand_path(str(p)) for p in data_files]
    if not paths:
        raise ValueError("RLHFDataset needs at least one parquet file, got an empty list")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"parquet file not found: {path}")
    return paths


def _resolve_pad_token_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token")
    logger.warning("tokenizer has no pad token; left-padding prompts with eos_token_id=%d", tokenizer.eos_token_id)
    return int(tokenizer.eos_token_id)


def _validate_row(row: dict[str, Any], path: str, row_index: int, prompt_key: str) -> None:
    """Raise ValueError naming the file, row and field if `row` does not follow the schema."""
    where = f"{path}: row {row_index}"
    messages = row.get(prompt_key)
    if messages is None:
        raise ValueError(f"{where}: field {prompt_key!r} is missing")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"{where}: field {prompt_key!r} must be a non-empty list of {{role, content}} messages, "
            f"got {type(messages).__name__}"
        )
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(
                f"{where}: field {prompt_key!r}[{position}] must be a dict with str 'role' and 'content', "
                f"got {message!r:.200}"
            )
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        raise ValueError(f"{where}: field 'data_source' is missing (a non-empty str naming the reward scorer)")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise ValueError(f"{where}: field 'reward_model' is missing (a dict with 'ground_truth')")
    if reward_model.get("ground_truth") is None:
        raise ValueError(f"{where}: field 'reward_model.ground_truth' is missing")
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise ValueError(f"{where}: field 'extra_info' must be a dict, got {type(extra_info).__name__}")


def _clean_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys that parquet adds when messages in a column have different keys."""
    return [{k: v for k, v in message.items() if v is not None} for message in messages]


def _agent_name(row: dict[str, Any]) -> str | None:
    if row.get("agent_name") is not None:
        return row["agent_name"]
    extra_info = row.get("extra_info")
    return extra_info.get("agent_name") if isinstance(extra_info, dict) else None


def _dict_or_empty(extra_info: Any, key: str) -> dict[str, Any]:
    value = extra_info.get(key) if isinstance(extra_info, dict) else None
    return value if isinstance(value, dict) else {}


def _left_pad(ids: list[int], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (n <= length) -> input_ids, attention_mask: (length,) int64 each, padding on the left."""
    num_pad = length - len(ids)
    input_ids = torch.tensor([pad_token_id] * num_pad + ids, dtype=torch.long)
    attention_mask = torch.tensor([0] * num_pad + [1] * len(ids), dtype=torch.long)
    return input_ids, attention_mask
