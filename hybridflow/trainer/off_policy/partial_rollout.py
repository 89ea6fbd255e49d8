"""Partial rollout: one prompt batch generated in resumable chunks, each token tagged with the weights that sampled it.

The rollouter asks the rollout pool for at most `chunk_tokens` new tokens per call (the per-call `max_new_tokens`
override every backend reads). Rows that stopped (a stop token) or reached `response_length` are done; the others
are sent again with their prompt extended by what they generated so far. A weight sync may come between two calls,
so a response can hold tokens from several policy versions:

    columns     [0, k)        [k, 2k)       [2k, 3k)
    chunk       1 (v0)        2 (v0)        3 (v1)        <- the sync to v1 came between chunks 2 and 3

A continued row is a left-padded prompt (prompt + prefix) to the engine, so its KV cache is recomputed by a new
prefill under the weights of that chunk (no engine keeps a cache across calls); the prefix tokens and their
`rollout_log_probs` stay those of the version that sampled them, which is what rollout correction needs (the
behaviour policy of each token). The same mechanism serves every backend (hf, native continuous batching, vllm)
since it only uses `generate_sequences`; with `chunk_tokens >= response_length` it is one ordinary call.

Rows still in flight always used their whole budget in every chunk (a shorter row stopped), so all of them have
generated the same number of tokens: a chunk's columns are the same for all of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridflow.engines.rollout.output import build_rollout_output
from hybridflow.protocol import DataProto
from hybridflow.trainer.generation import PROMPT_KEYS
from hybridflow.trainer.guards.versions import check_served_version, served_versions

CHUNK_KEY = "sampling_seed_offset"
"""`meta_info` key carrying the chunk index (0, 1, ...) of a call: the rollout worker seeds each chunk's sampling
differently (one seed per policy version would replay the same random stream in every chunk of a version)."""


class PartialRollout:
    """The generation state of one prompt batch: `request()` the next chunk's prompts, `add()` the rollout's output,
    `finish()` once `done` (see the module docstring)."""

    def __init__(
        self,
        prompts: DataProto,
        response_length: int,
        chunk_tokens: int,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
    ) -> None:
        """
        Args:
            prompts: what `build_prompts` sends the rollout (left-padded `input_ids`, `attention_mask`,
                `position_ids`; `meta_info` with `validate` and overrides), one row per response.
            response_length: most tokens per response (`rollout.response_length`).
            chunk_tokens: most tokens per call (`async_training.partial_rollout_chunk_tokens`, or response_length).
            stop_token_ids: ids that end a response (the tokenizer's eos, and the call's stop tokens, if any).
            pad_token_id: written into the pad columns of `responses`.
        """
        if chunk_tokens < 1 or response_length < 1:
            raise ValueError(f"chunk_tokens and response_length must be >= 1, got {chunk_tokens}, {response_length}")
        self.prompts, self.response_length, self.chunk_tokens = prompts, response_length, chunk_tokens
        self.stop_token_ids = torch.tensor(list(stop_token_ids), dtype=torch.long)
        self.pad_token_id = pad_token_id
        size = len(prompts)
        self.responses = torch.full((size, response_length), pad_token_id, dtype=torch.long)
        self.response_mask = torch.zeros((size, response_length), dtype=torch.long)
        self.log_probs = torch.zeros((size, response_length), dtype=torch.float32)
        self.param_versions = torch.full((size, response_length), -1, dtype=torch.long)
        self.policy_versions = torch.full((size, response_length), -1, dtype=torch.long)
        self.active = torch.arange(size)  # rows still generating
        self.num_generated = 0  # tokens every active row has generated
        self.num_chunks = 0
        self.metrics: dict[str, float] = {}
        self._next = prompts  # the prompts of the next chunk, one row per active row

    @property
    def done(self) -> bool:
        """Whether every row has stopped or reached `response_length`."""
        return self.active.numel() == 0

    @property
    def budget(self) -> int:
        """New tokens the next chunk may generate per row."""
        return min(self.chunk_tokens, self.response_length - self.num_generated)

    def request(self) -> DataProto:
        """The next chunk's prompts: the active rows' prompt + prefix, with `max_new_tokens` set to `budget`."""
        assert not self.done, "request() after the last chunk"
        prompts = self._next.select(meta_info_keys=[])
        prompts.meta_info = {**self.prompts.meta_info, "max_new_tokens": self.budget, CHUNK_KEY: self.num_chunks}
        return prompts

    def add(self, output: DataProto, param_version: int, policy_version: int) -> None:
        """Record one chunk's `output` (the rollout's answer to `request()`), generated by the weights of
        `param_version` (weight syncs) and `policy_version` (actor updates)."""
        budget, rows = self.budget, self.active
        check_served_version(f"chunk {self.num_chunks} of a partial rollout", served_versions(output), policy_version)
        responses, mask = output.batch["responses"], output.batch["response_mask"]
        assert tuple(responses.shape) == (rows.numel(), budget), (tuple(responses.shape), rows.numel(), budget)
        columns = slice(self.num_generated, self.num_generated + budget)
        self.responses[rows, columns] = responses
        self.response_mask[rows, columns] = mask.long()
        self.log_probs[rows, columns] = output.batch["rollout_log_probs"].float()
        sampled = mask.bool()
        self.param_versions[rows, columns] = torch.where(sampled, param_version, -1)
        self.policy_versions[rows, columns] = torch.where(sampled, policy_version, -1)
        for key, value in output.meta_info.get("metrics", {}).items():  # timings add up over the chunks
            self.metrics[key] = self.metrics.get(key, 0.0) + float(np.mean(value))
        self.num_generated += budget
        self.num_chunks += 1
        going_on = compute_unfinished_rows(responses, mask, self.stop_token_ids)
        if self.num_generated >= self.response_length:
            going_on[:] = False
        self.active = rows[going_on]
        keep = going_on.nonzero().flatten().tolist()
        self._next = output.select_idxs(keep).select(batch_keys=list(PROMPT_KEYS))

    def finish(self) -> DataProto:
        """The whole batch in the rollout layout (`engines/rollout/base.py`) plus `token_param_versions` and
        `token_policy_versions`, (bs, response_len) int64, -1 where `response_mask` is 0; `meta_info['metrics']`
        holds the chunks' summed timings and `partial_rollout/num_chunks`."""
        assert self.done, "finish() before the last chunk"
        prompts = self.prompts.batch
        output = build_rollout_output(
            prompts["input_ids"], prompts["attention_mask"], prompts["position_ids"],
            self.responses, self.response_mask, self.log_probs, self.pad_token_id,
            non_tensor=self.prompts.non_tensor_batch, meta_info=self.prompts.meta_info,
        )
        output.batch["token_param_versions"] = self.param_versions
        output.batch["token_policy_versions"] = self.policy_versions
        output.meta_info["metrics"] = {**self.metrics, "partial_rollout/num_chunks": float(self.num_chunks)}
        return output


def compute_unfinished_rows(responses: torch.Tensor, response_mask: torch.Tensor, stop_token_ids: torch.Tensor):
    """Rows of one chunk that must go on: they used the whole chunk and their last token is no stop token.

    responses, response_mask: (rows, budget) -> (rows,) bool.
    """
    lengths = response_mask.long().sum(dim=1)
    full = lengths == responses.size(1)
    stopped = torch.isin(responses[:, -1], stop_token_ids.to(responses.device))
    return full & ~stopped


def compute_version_metrics(
    token_versions: torch.Tensor, response_mask: torch.Tensor, current_version: int
) -> dict[str, float]:
    """How old a batch's tokens are, and how many of its samples span several policy versions.

    token_versions: (bs, response_len) int64, the param version (weight syncs) that sampled each token, -1 on
    padding; response_mask: (bs, response_len); current_version: the rollout's param version at training time.
    Returns `fully_async/token_staleness/{mean,max}` (current_version - version, over sampled tokens) and verl's
    `fully_async/partial/{total_partial_num,partial_ratio,max_partial_span}` (samples whose newest and oldest tokens
    differ in version; the largest difference).
    """
    sampled = response_mask.bool() & (token_versions >= 0)
    staleness = (current_version - token_versions)[sampled].float()
    newest = torch.where(sampled, token_versions, -1).max(dim=1).values
    oldest = torch.where(sampled, token_versions, torch.iinfo(torch.long).max).min(dim=1).values
    span = torch.where(sampled.any(dim=1), newest - oldest, 0)
    num_partial = int((span > 0).sum())
    return {
        "fully_async/token_staleness/mean": float(staleness.mean()) if staleness.numel() else 0.0,
        "fully_async/token_staleness/max": float(staleness.max()) if staleness.numel() else 0.0,
        "fully_async/partial/total_partial_num": float(num_partial),
        "fully_async/partial/partial_ratio": num_partial / max(1, span.numel()),
        "fully_async/partial/max_partial_span": float(span.max()) if span.numel() else 0.0,
    }
