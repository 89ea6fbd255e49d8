"""Shared-prompt forwards equal per-sequence forwards: log-probs, entropy, values and the training step."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import torch

from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.prefix_sharing import build_shared_prompt_layout
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from tests.engines.helpers import make_batch

N = 4  # samples per prompt


def grouped_batch(vocab_size: int) -> DataProto:
    """3 prompts x N samples: each group's rows share the (left-padded) prompt, responses differ in tokens and
    length; one extra row has a prompt of its own."""
    base = make_batch(vocab_size, batch_size=3 * N + 1, prompt_len=6, response_len=5, seed=1)
    tensors = {key: value.clone() for key, value in base.batch.items()}
    for group in range(3):
        rows = slice(group * N, (group + 1) * N)
        for key in ("input_ids", "attention_mask", "position_ids"):
            tensors[key][rows, :6] = tensors[key][group * N, :6]
        prompt_end = tensors["position_ids"][group * N, 5]
        response_mask = tensors["attention_mask"][rows, 6:]
        tensors["position_ids"][rows, 6:] = prompt_end + response_mask.cumsum(-1) * response_mask
    tensors["responses"] = tensors["input_ids"][:, 6:]
    tensors["response_mask"] = tensors["attention_mask"][:, 6:]
    return DataProto.from_dict(tensors=tensors)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    return grouped_batch(len(tiny_tokenizer))


def test_layout_computes_each_prompt_once(batch):
    t = batch.batch
    layout = build_shared_prompt_layout(t["input_ids"], t["attention_mask"], t["position_ids"], 5)
    prompt_tokens = t["attention_mask"][:, :6].sum(-1)
    response_tokens = int(t["attention_mask"][:, 6:].sum())
    distinct_prompts = int(prompt_tokens[[0, N, 2 * N, 3 * N]].sum())
    assert layout.num_tokens == distinct_prompts + response_tokens < int(t["attention_mask"].sum())
    # The first response token of every row in a group is predicted by the same (last prompt) token.
    assert len(set(layout.predictors[:N, 0].tolist())) == 1
    assert ((layout.predictors >= 0) == t["attention_mask"][:, 6:].bool()).all()
    # Prompts of different lengths end in one column, so the head projects no more columns than the longest
    # group's response tokens, in each row.
    group_responses = [int(t["attention_mask"][rows, 6:].sum()) for rows in (slice(0, N), slice(N, 2 * N),
                                                                          slice(2 * N, 3 * N), slice(3 * N, None))]
    assert len(set(prompt_tokens[[0, N, 2 * N, 3 * N]].tolist())) > 1
    assert layout.kept.numel() <= max(group_responses)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_log_probs_and_entropy_equal_separate_forwards(tiny_llama_dir, batch, remove_padding):
    model = ModelConfig(path=tiny_llama_dir, use_remove_padding=remove_padding)
    plain = build_fsdp_engine(tiny_llama_dir, FSDPEngineConfig(model=model, micro_batch_size_per_gpu=5))
    shared = build_fsdp_engine(
        tiny_llama_dir, FSDPEngineConfig(model=model, micro_batch_size_per_gpu=5, share_prompts=True)
    )
    mask = batch.batch["response_mask"].bool()
    lp_plain, ent_plain = plain.compute_log_prob(batch, temperature=0.7, calculate_entropy=True)
    lp_shared, ent_shared = shared.compute_log_prob(batch, temperature=0.7, calculate_entropy=True)
    assert (lp_plain - lp_shared)[mask].abs().max() < 1e-5
    assert (ent_plain - ent_shared)[mask].abs().max() < 1e-5


def test_values_equal_separate_forwards(tiny_llama_dir, batch):
    config = FSDPEngineConfig(model=ModelConfig(path=tiny_llama_dir), micro_batch_size_per_gpu=13)
    plain = build_fsdp_engine(tiny_llama_dir, config, model_kind="value")
    shared = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(config, share_prompts=True), model_kind="value")
    mask = batch.batch["response_mask"].bool()
    assert (plain.compute_values(batch) - shared.compute_values(batch))[mask].abs().max() < 1e-5


def test_training_step_equals_separate_forwards(tiny_llama_dir, batch):
    def token_nll(outputs, micro_batch):
        token_mask = micro_batch.batch["response_mask"].to(outputs["log_probs"].dtype)
        return -(outputs["log_probs"] * token_mask).sum() / token_mask.sum(), {}

    config = FSDPEngineConfig(
        model=ModelConfig(path=tiny_llama_dir), micro_batch_size_per_gpu=13, optim=OptimConfig(lr=1e-2)
    )
    plain = build_fsdp_engine(tiny_llama_dir, config)
    shared = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(config, share_prompts=True))
    for engine in (plain, shared):  # the gradients themselves (Adam's first step would amplify rounding)
        token_nll(engine.forward_micro_batch(batch), batch)[0].backward()
    plain_grads = {name: p.grad for name, p in plain.module.named_parameters()}
    for name, param in shared.module.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[name], atol=1e-5, rtol=0)
    a = plain.train_batch(batch, token_nll)
    b = shared.train_batch(batch, token_nll)
    assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5


@pytest.mark.parametrize("budget", [30, 12])
def test_token_budget_micro_batches_keep_prompt_groups(tiny_llama_dir, batch, budget):
    """use_dynamic_bsz with shared prompts: micro-batches of about `budget` tokens hold whole prompt groups (30: every
    group fits; 12: a group over the budget is cut into runs of rows that each share the prompt again), and the
    log-probs equal per-sequence forwards."""
    model = ModelConfig(path=tiny_llama_dir)
    plain = build_fsdp_engine(tiny_llama_dir, FSDPEngineConfig(model=model, micro_batch_size_per_gpu=13))
    shared = build_fsdp_engine(
        tiny_llama_dir, FSDPEngineConfig(model=model, micro_batch_size_per_gpu=13, share_prompts=True)
    )
    t = batch.batch
    micro_batches, order = shared.split_micro_batches(batch, max_token_len=budget)
    assert len(micro_batches) > 1 and sorted(order) == list(range(len(batch)))
    sizes = [len(mb) for mb in micro_batches]
    holder = {row: index for index, rows in enumerate(_cut(order, sizes)) for row in rows}
    prompt_tokens = t["attention_mask"][:, :6].sum(-1).tolist()
    response_tokens = t["attention_mask"][:, 6:].sum(-1).tolist()
    for group in range(3):
        rows = range(group * N, (group + 1) * N)
        if prompt_tokens[group * N] + sum(response_tokens[row] for row in rows) <= budget:
            assert len({holder[row] for row in rows}) == 1, f"group {group} was split though it fits the budget"
    for micro_batch in micro_batches:  # the shared-prompt forward's tokens fit the budget
        layout = shared.plan_micro_batches([micro_batch])[0].shared
        assert layout.num_tokens <= budget
    mask = t["response_mask"].bool()
    lp_plain, ent_plain = plain.compute_log_prob(batch, temperature=0.7, calculate_entropy=True)
    lp_shared, ent_shared = shared.compute_log_prob(batch, temperature=0.7, calculate_entropy=True, max_token_len=budget)
    assert (lp_plain - lp_shared)[mask].abs().max() < 1e-5
    assert (ent_plain - ent_shared)[mask].abs().max() < 1e-5
    if budget == 30:  # each prompt computed once: distinct prompts plus every response token
        distinct = sum(prompt_tokens[row] for row in (0, N, 2 * N, 3 * N))
        assert shared.pop_work()[False].num_tokens == distinct + sum(response_tokens)


def _cut(order: list[int], sizes: list[int]) -> list[list[int]]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [order[start : start + size] for start, size in zip(starts, sizes)]


def test_a_16k_token_layout_is_linear_in_tokens():
    """8 prompts of 256 tokens x 8 responses of 224 (in 240 columns): 16k tokens. The layout's tensors are
    O(tokens), building it allocates a few MB on the host, and the dense mask sdpa gets is one 2048 x 2048 block
    per group (33 MB), not 16k x 16k (268 MB)."""
    groups, samples, prompt_len, response_len = 8, 8, 256, 240
    rng = np.random.default_rng(0)
    rows = groups * samples
    ids = rng.integers(3, 1000, (rows, prompt_len + response_len))
    for group in range(groups):
        ids[group * samples : (group + 1) * samples, :prompt_len] = ids[group * samples, :prompt_len]
    mask = np.ones_like(ids)
    mask[:, -16:] = 0  # right-padded responses of 224 tokens
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    tracemalloc.start()
    layout = build_shared_prompt_layout(ids, mask, pos, response_len)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    total = groups * (prompt_len + samples * (response_len - 16))
    assert layout.num_tokens == total == 16_384
    tensors = [value for value in vars(layout).values() if isinstance(value, torch.Tensor)]
    assert max(t.numel() for t in tensors) <= max(total, rows * response_len)  # nothing of total x total
    assert peak < 16 * 2**20, f"building the layout peaked at {peak / 2**20:.1f} MB"
    length = prompt_len + samples * (response_len - 16)
    assert (layout.groups, layout.length) == (groups, length) == tuple(layout.input_ids.shape)
    mask = layout.attention_mask()
    assert mask.shape == (groups, 1, length, length) and mask.numel() == total * length <= total * total // groups
    # Row 0 is group 0's own block: its first response attends to the prompt and itself, never to the second one.
    first, second = prompt_len, prompt_len + response_len - 16
    assert mask[0, 0, first + 3, : first + 4].all() and not mask[0, 0, second + 1, first : second].any()
