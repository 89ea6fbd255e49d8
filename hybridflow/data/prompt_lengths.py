"""Token counts of chat prompts after the chat template, in this process or over several worker processes
(`data.filter_overlong_prompts_workers`, verl's key): rendering each template and tokenizing it is what measuring
a large prompt file costs."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from hybridflow.utils.processes import start_method

CHUNK = 1024
"""Prompts per batched tokenizer call (and per task handed to a worker process)."""

_WORKER_TOKENIZER: Any = None


def chat_prompt_lengths(
    tokenizer: Any, conversations: Sequence[list[dict[str, Any]]], template_kwargs: dict[str, Any], workers: int = 1
) -> list[int]:
    """Tokens of each conversation rendered with the generation prompt (no special tokens added), in order.
    `workers` > 1 spreads chunks of CHUNK conversations over that many forked processes (at most the CPUs here);
    fewer than two chunks run in this process."""
    chunks = [list(conversations[start:start + CHUNK]) for start in range(0, len(conversations), CHUNK)]
    workers = min(workers, os.cpu_count() or 1, len(chunks))
    if workers <= 1:
        return [length for chunk in chunks for length in _lengths(tokenizer, chunk, template_kwargs)]
    # fork: the workers start in milliseconds with the tokenizer already loaded (the dataset is built in the driver
    # before Ray starts); a process already connected to Ray starts them from a fork server
    context = multiprocessing.get_context(start_method("fork", "the prompt-length workers"))
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_set_worker_tokenizer,
                             initargs=(tokenizer,)) as pool:
        parts = pool.map(_worker_lengths, chunks, [template_kwargs] * len(chunks))
        return [length for part in parts for length in part]


def _set_worker_tokenizer(tokenizer: Any) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no thread pool of the tokenizers library per worker
    _WORKER_TOKENIZER = tokenizer


def _worker_lengths(chunk: list[list[dict[str, Any]]], template_kwargs: dict[str, Any]) -> list[int]:
    return _lengths(_WORKER_TOKENIZER, chunk, template_kwargs)


def _lengths(tokenizer: Any, chunk: list[list[dict[str, Any]]], template_kwargs: dict[str, Any]) -> list[int]:
    if not chunk:
        return []
    texts = [render_chat_prompt(tokenizer, messages, template_kwargs) for messages in chunk]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> str:
    """A conversation as the policy sees its prompt: the chat template with the generation prompt, not tokenized."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
