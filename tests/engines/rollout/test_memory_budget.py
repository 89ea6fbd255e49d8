"""rollout.gpu_memory_utilization in the hf and native engines: the budget's arithmetic, and generation that holds
no more rows (hf) or cache slots (native) than the budget fits, with the same output as without a budget."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.rollout.memory_budget import (
    MemoryBudget,
    format_bytes,
    kv_bytes_per_token,
    kv_bytes_per_token_of,
    module_bytes,
    rollout_memory_budget,
)
from hybridflow.engines.rollout.native import NativeRollout
from hybridflow.engines.rollout.native.batcher import serving_capacity_within
from hybridflow.utils.device import device_memory_bytes
from tests.engines.helpers import encode_prompts

GREEDY = SamplingParams(max_new_tokens=6, do_sample=False)
PROMPTS = ["hello there", "what is 12 + 7?", "x", "def add(a, b):", "one two three", "the sea"]


def test_byte_counts_read_at_their_scale():
    assert [format_bytes(n) for n in (512, 12_595, 1.5 * 2**20, 2 * 1024**3)] == ["512 B", "12.3 KiB", "1.5 MiB", "2 GiB"]


def test_budget_arithmetic_and_its_errors():
    budget = MemoryBudget(utilization=0.5, device_bytes=1000, weight_bytes=300)
    assert budget.free_bytes == 200 and budget.max_sequences(30) == 6
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.5 .*room for 6 sequence.*fewer than the 8"):
        budget.max_sequences(30, needed=8)
    with pytest.raises(ValueError, match=r"less than its weights.*raise gpu_memory_utilization"):
        MemoryBudget(utilization=0.2, device_bytes=1000, weight_bytes=300)


def test_kv_bytes_follow_grouped_query_heads_and_head_dim():
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    assert kv_bytes_per_token_of(config, torch.bfloat16) == 2 * 3 * 2 * 16 * 2 == kv_bytes_per_token(3, 2, 16, torch.bfloat16)
    plain = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    assert kv_bytes_per_token_of(plain, torch.float32) == 2 * 1 * 4 * 16 * 4


def test_tied_weights_count_once():
    lm = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    lm[1].weight = lm[0].weight
    assert module_bytes(lm) == 10 * 4 * 4


def test_serving_capacity_leaves_room_for_padding_and_parking():
    assert serving_capacity_within(16, prefix_reuse=True) == 8  # 8 decode + 8 parked
    assert serving_capacity_within(40, prefix_reuse=True) == 16  # 16 + 16 (24 + 24 would not fit)
    assert serving_capacity_within(17, prefix_reuse=False) == 16
    assert serving_capacity_within(9, prefix_reuse=True) == 1 and serving_capacity_within(7, prefix_reuse=False) == 0


def _utilization_for(weight_bytes: int, per_sequence: int, sequences: float) -> float:
    """The utilization that leaves room for `sequences` sequences after the weights on this host."""
    return (weight_bytes + sequences * per_sequence) / device_memory_bytes(torch.device("cpu"))


def test_hf_rollout_splits_generate_calls_to_the_budget(tiny_llama_dir, tiny_tokenizer):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    expected = HFRollout(tiny_llama_dir, tiny_tokenizer, GREEDY).generate_sequences(prompts)
    probe = HFRollout(tiny_llama_dir, tiny_tokenizer, GREEDY)
    per_row = probe._kv_bytes_per_token * (prompts.batch["input_ids"].size(1) + 6) + probe._logits_bytes_per_row
    utilization = _utilization_for(module_bytes(probe.model), per_row, 2.5)
    rollout = HFRollout(tiny_llama_dir, tiny_tokenizer, GREEDY, memory_utilization=utilization)
    rows_per_call = []
    generate = rollout.model.generate
    rollout.model.generate = lambda **kw: rows_per_call.append(len(kw["input_ids"])) or generate(**kw)
    out = rollout.generate_sequences(prompts)
    assert rows_per_call == [2, 2, 2]
    assert torch.equal(out.batch["responses"], expected.batch["responses"])
    with pytest.raises(ValueError, match="less than its weights"):
        HFRollout(tiny_llama_dir, tiny_tokenizer, GREEDY, memory_utilization=1e-9)


def test_native_rollout_holds_no_more_slots_than_the_budget(tiny_llama_dir, tiny_tokenizer):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS, {"n": 2})
    sampled = SamplingParams(max_new_tokens=6, do_sample=False, n=2)
    expected = NativeRollout(tiny_llama_dir, tiny_tokenizer, sampled).generate_sequences(prompts)
    probe = NativeRollout(tiny_llama_dir, tiny_tokenizer, sampled)
    longest = int(prompts.batch["attention_mask"].sum(1).max()) + 6
    utilization = _utilization_for(module_bytes(probe.model), probe.cache.bytes_per_token * longest, 5.5)
    rollout = NativeRollout(tiny_llama_dir, tiny_tokenizer, sampled, memory_utilization=utilization)
    out = rollout.generate_sequences(prompts)
    assert rollout.cache.num_slots == 5  # 12 rows through 5 slots (unpadded: 8 would not fit)
    assert torch.equal(out.batch["responses"], expected.batch["responses"])
    with pytest.raises(ValueError, match=r"room for 1 sequence\(s\) of [0-9.]+ KiB each, fewer than the 2 decoded"):
        tight = _utilization_for(module_bytes(probe.model), probe.cache.bytes_per_token * longest, 1.5)
        NativeRollout(tiny_llama_dir, tiny_tokenizer, sampled, memory_utilization=tight).generate_sequences(prompts)


def test_on_the_host_each_local_rank_takes_its_share_of_the_ram(tiny_llama_dir, tiny_tokenizer, monkeypatch):
    """Two ranks of a worker group on one host share its RAM: each rollout's budget is utilization x RAM / 2, so
    the two together stay within utilization x RAM."""
    host = device_memory_bytes(torch.device("cpu"))
    probe = NativeRollout(tiny_llama_dir, tiny_tokenizer, GREEDY)
    alone = rollout_memory_budget(probe.model, torch.device("cpu"), 0.5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = rollout_memory_budget(probe.model, torch.device("cpu"), 0.5)
    assert alone.device_bytes == host and shared.device_bytes == host // 2
    assert shared.free_bytes == int(0.5 * (host // 2)) - module_bytes(probe.model)
