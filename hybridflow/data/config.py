"""The settings `RLHFDataset` reads, as one frozen dataclass.

The trainer owns the user-facing `data.*` config (verl's keys); it builds an `RLHFDatasetConfig` from it:
`data.prompt_key`, `data.max_prompt_length`, `data.truncation`, `data.filter_overlong_prompts`,
`data.return_raw_chat` and `data.apply_chat_template_kwargs` map one to one onto the fields below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True)
class RLHFDatasetConfig:
    """How `RLHFDataset` turns parquet rows into left-padded prompt tensors."""

    prompt_key: str = "prompt"
    """Column holding the chat messages (a list of {role, content})."""

    max_prompt_length: int = 512
    """Prompt length in tokens after the chat template; tensors are left-padded to exactly this length."""

    truncation: Literal["error", "left", "right", "middle"] = "error"
    """What to do with a prompt longer than `max_prompt_length` that was not filtered out:
    'error' raises naming the row, 'left' keeps the last tokens, 'right' the first ones,
    'middle' keeps both ends."""

    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` when the dataset is built (one warning with the count)."""

    return_raw_chat: bool = False
    """Also return the chat messages as `raw_prompt` (needed by agent loops and chat-based rollouts)."""

    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `tokenizer.apply_chat_template` (e.g. {'enable_thinking': False})."""

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ValueError(
                f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}; set it to the longest prompt "
                "(in tokens, after the chat template) you want to keep"
            )
        if self.truncation not in ("error", "left", "right", "middle"):
            raise ValueError(
                f"data.truncation must be one of 'error', 'left', 'right', 'middle', got {self.truncation!r}"
            )
        if not self.prompt_key:
            raise ValueError("data.prompt_key must name a column, got an empty string")
        reserved = {"messages", "add_generation_prompt", "tokenize"}
        clash = reserved & set(self.apply_chat_template_kwargs)
        if clash:
            raise ValueError(
                f"data.apply_chat_template_kwargs may not set {sorted(clash)}: the dataset sets them itself"
            )
