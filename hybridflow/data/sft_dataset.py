"""`SFTDataset`: parquet rows -> chat-templated token ids with a loss mask on the assistant tokens; `collate`.

Two row layouts (verl's SFT keys):

- single-turn: `prompt_key` holds the user prompt (a string, or a list of {role, content} messages as in the
  RL schema) and `response_key` the assistant's answer (a string). `prompt_dict_keys` / `response_dict_keys`
  pick a value inside a dict column (verl's `data.prompt_dict_keys`, e.g. `extra_info` -> `question`).
- multi-turn (`multiturn=True`): `messages_key` holds the whole conversation; `tools_key` (optional column)
  the tool schemas passed to the chat template.

Both are rendered with the tokenizer's chat template. The loss mask is 1 exactly on the tokens of assistant
turns that the model must produce: the content and the end-of-turn token (eos), not the
`<|im_start|>assistant\n` header, not what the template adds after eos, and never system/user/tool turns.
Token `i` with `loss_mask[i] == 1` is predicted from tokens `< i` (so `loss_mask[0]` is always 0).

Each conversation is tokenized segment by segment (the text each message adds to the rendered prefix), so the
mask is exact; a chat template whose rendering of a prefix is not a prefix of the full rendering (templates
that rewrite earlier turns) is rejected naming the row.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from hybridflow.data.config import SFTDataConfig, expand_path
from hybridflow.data.rl_dataset import _clean_messages, _resolve_pad_token_id, compute_position_ids

__all__ = ["SFTDataset", "tokenize_conversation"]

logger = logging.getLogger(__name__)


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Any = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    whole_conversation_check: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated conversation and its loss mask (1 on assistant content + eos).

    With `whole_conversation_check`, the message-by-message ids must equal the tokenization of the whole rendered
    conversation (verl's check; a tokenizer may merge characters across a turn boundary).

    Raises:
        ValueError: no assistant message, a chat template that is not prefix-stable, or (checked) ids that differ
            from the whole conversation's.
    """
    kwargs = dict(chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    messages = _clean_messages(messages)
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("the conversation has no assistant message: nothing to train on")

    def render(upto: int, generation_prompt: bool) -> str:
        if upto == 0 and not generation_prompt:
            return ""
        return tokenizer.apply_chat_template(
            messages[:upto], add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )

    segments: list[tuple[str, bool]] = []  # (text, is assistant output)
    previous = ""
    for index, message in enumerate(messages):
        rendered = render(index + 1, False)
        header = render(index, True) if message["role"] == "assistant" else previous
        if not (header.startswith(previous) and rendered.startswith(header)):
            raise ValueError(
                f"the chat template rewrites earlier turns (message {index} does not extend the rendered prefix); "
                "per-turn loss masks need a prefix-stable template"
            )
        if header != previous:
            segments.append((header[len(previous):], False))
        segments.append((rendered[len(header):], message["role"] == "assistant"))
        previous = rendered
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        piece_mask = _assistant_mask(piece, tokenizer.eos_token_id) if trained else [0] * len(piece)
        ids.extend(piece)
        mask.extend(piece_mask)
    if mask and mask[0]:
        mask[0] = 0  # the first token is never predicted
    if whole_conversation_check:
        whole = tokenizer(previous, add_special_tokens=False)["input_ids"] if previous else []
        if list(whole) != ids:
            at = next((i for i, (a, b) in enumerate(zip(whole, ids)) if a != b), min(len(whole), len(ids)))
            raise ValueError(
                f"tokenized message by message, the conversation's ids differ from the whole conversation's "
                f"tokenization at token {at} ({len(ids)} against {len(whole)} tokens): the tokenizer merges "
                "characters across a turn boundary. Set data.ignore_input_ids_mismatch=True to train on the "
                "message-by-message ids (verl's behaviour), or change the conversation"
            )
    return ids, mask


def _assistant_mask(ids: list[int], eos_token_id: int | None) -> list[int]:
    """1 up to and including the last eos of an assistant segment (0 after it: template glue like '\\n')."""
    if eos_token_id is None or eos_token_id not in ids:
        return [1] * len(ids)
    last_eos = len(ids) - 1 - ids[::-1].index(eos_token_id)
    return [1] * (last_eos + 1) + [0] * (len(ids) - last_eos - 1)


class SFTDataset(Dataset):
    """Supervised fine-tuning samples from parquet files (see the module docstring for the row layouts).

    Every row is tokenized when the dataset is built, so a malformed row fails at once naming the file,
    the row and the field. Items are unpadded: `input_ids`, `attention_mask`, `position_ids`, `loss_mask`,
    each (length,) int64; `collate` right-pads a batch to its longest sample.
    """

    def __init__(
        self,
        data_files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        config: SFTDataConfig,
        max_samples: int = -1,
    ) -> None:
        """Tokenize every row of `data_files` (at most the first `max_samples` rows; -1: all)."""
        self.config = config
        self.tokenizer = tokenizer
        self.pad_token_id = _resolve_pad_token_id(tokenizer)
        if isinstance(data_files, (str, os.PathLike)):
            data_files = [data_files]
        self.data_files = [expand_path(str(path)) for path in data_files]
        if not self.data_files:
            raise ValueError("SFTDataset needs at least one parquet file (data.train_files), got an empty list")
        self.samples: list[tuple[list[int], list[int]]] = []
        num_truncated = 0
        for path in self.data_files:
            if not path.is_file():
                raise FileNotFoundError(f"parquet file not found: {path}")
            for row_index, row in enumerate(pq.read_table(path).to_pylist()):
                if 0 < max_samples <= len(self.samples):
                    break
                where = f"{path}: row {row_index}"
                messages, tools = self._messages(row, where)
                try:
                    ids, mask = tokenize_conversation(
                        tokenizer, messages, tools=tools, chat_template_kwargs=self._template_kwargs(row),
                        whole_conversation_check=config.multiturn.enable and not config.ignore_input_ids_mismatch,
                    )
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from err
                if len(ids) > config.max_length:
                    ids, mask = self._truncate(ids, mask, where)
                    num_truncated += 1
                self.samples.append((ids, mask))
        if num_truncated:
            logger.warning("truncated %d samples to data.max_length=%d (%s side)", num_truncated,
                           config.max_length, config.truncation)
        if not self.samples:
            raise ValueError(f"no rows in {[str(p) for p in self.data_files]}")

    def _template_kwargs(self, row: dict[str, Any]) -> dict[str, Any]:
        """data.apply_chat_template_kwargs, with a multi-turn row's own enable_thinking where its column holds one."""
        kwargs = dict(self.config.apply_chat_template_kwargs)
        multiturn = self.config.multiturn
        if multiturn.enable and row.get(multiturn.enable_thinking_key) is not None:
            kwargs["enable_thinking"] = bool(row[multiturn.enable_thinking_key])
        return kwargs

    def _messages(self, row: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], Any]:
        config = self.config
        if config.multiturn.enable:
            multiturn = config.multiturn
            messages = _field(row, multiturn.messages_key, (), where)
            _check_messages(messages, multiturn.messages_key, where)
            tools = row.get(multiturn.tools_key)
            return list(messages), tools
        prompt = _field(row, config.prompt_key, config.prompt_dict_keys, where)
        response = _field(row, config.response_key, config.response_dict_keys, where)
        if not isinstance(response, str):
            raise ValueError(f"{where}: field {config.response_key!r} must be a str, got {type(response).__name__}")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        _check_messages(prompt, config.prompt_key, where)
        return [*prompt, {"role": "assistant", "content": response}], None

    def _truncate(self, ids: list[int], mask: list[int], where: str) -> tuple[list[int], list[int]]:
        limit = self.config.max_length
        if self.config.truncation == "error":
            raise ValueError(
                f"{where}: sample has {len(ids)} tokens > data.max_length={limit}; raise data.max_length or set "
                "data.truncation to 'left' or 'right'"
            )
        if self.config.truncation == "right":
            return ids[:limit], mask[:limit]
        ids, mask = ids[-limit:], mask[-limit:]
        return ids, [0, *mask[1:]]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples[index]
        input_ids = torch.tensor(ids, dtype=torch.long)
        attention_mask = torch.ones_like(input_ids)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
        }

    def collate(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest item: (bs, max_len) tensors; padding has attention_mask = loss_mask = 0."""
        length = max(item["input_ids"].size(0) for item in items)
        batch = {}
        for key in ("input_ids", "attention_mask", "position_ids", "loss_mask"):
            fill = self.pad_token_id if key == "input_ids" else 0
            batch[key] = torch.stack([
                torch.nn.functional.pad(item[key], (0, length - item[key].size(0)), value=fill) for item in items
            ])
        return batch


def _field(row: dict[str, Any], key: str, dict_keys: Sequence[str], where: str) -> Any:
    if key not in row or row[key] is None:
        raise ValueError(f"{where}: field {key!r} is missing (columns: {sorted(row)})")
    value = row[key]
    path = key
    for sub in dict_keys:
        if not isinstance(value, dict) or sub not in value:
            raise ValueError(f"{where}: field {path!r} has no key {sub!r}")
        value, path = value[sub], f"{path}.{sub}"
    return value


def _check_messages(messages: Any, key: str, where: str) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: field {key!r} must be a non-empty list of {{role, content}} messages")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not (isinstance(message.get("content"), str) or message.get("tool_calls")):
            raise ValueError(
                f"{where}: field {key!r}[{position}] must be a dict with str 'role' and 'content' (or 'tool_calls')"
            )
