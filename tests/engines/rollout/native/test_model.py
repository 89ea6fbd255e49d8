"""The compact forward against the HF module: prefill and decode logits for Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout.native.kv_cache import KVCache
from hybridflow.engines.rollout.native.model import LlamaFamilyForward


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch_ops", "cpu_kernels"])
@torch.inference_mode()
def test_prefill_and_decode_logits_match_transformers(sharp_model, cpu_kernels, use_kernels):
    forward = LlamaFamilyForward(sharp_model, cpu_kernels if use_kernels else None)
    assert (forward.kernels is not None) == use_kernels
    cache = KVCache(forward.num_layers, forward.num_kv_heads, forward.head_dim, torch.float32, torch.device("cpu"))
    cache.reserve(num_slots=4, max_len=12)
    forward.bind(max_position=12)
    vocab = sharp_model.config.vocab_size
    seqs = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 8)]
    reference = [sharp_model(seq[None]).logits[0] for seq in seqs]  # (len, vocab) per sequence

    # Prefill the first 4 and 6 tokens (right-padded to 6), each prompt into 2 slots.
    lengths = torch.tensor([4, 6])
    ids = torch.stack([torch.cat([seqs[0][:4], seqs[0][:2]]), seqs[1][:6]])
    logits = forward.prefill(ids, torch.arange(6).expand(2, 6), lengths - 1, cache, start_slot=0, repeats=2)
    torch.testing.assert_close(logits, torch.stack([reference[0][3], reference[1][5]]), atol=1e-4, rtol=1e-4)

    # Decode the next real token in all 4 slots; slots 2 and 3 hold the longer sequence.
    tokens = torch.stack([seqs[0][4], seqs[0][4], seqs[1][6], seqs[1][6]])
    positions = torch.tensor([4, 4, 6, 6])
    logits = forward.decode(tokens, positions, positions.clone(), span=7, cache=cache)
    expected = torch.stack([reference[0][4], reference[0][4], reference[1][6], reference[1][6]])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_packed_weights_follow_in_place_changes_and_release(sharp_model, cpu_kernels):
    forward = LlamaFamilyForward(sharp_model, cpu_kernels)
    forward.bind(max_position=4)
    weight = sharp_model.model.layers[0].mlp.up_proj.weight
    first = forward._packed.get(weight)
    assert forward._packed.get(weight) is first  # unchanged weight: the same packed copy
    with torch.no_grad():
        weight.mul_(2)  # an in-place change bumps the version
    second = forward._packed.get(weight)
    assert second is not first and torch.equal(second, cpu_kernels.pack_weight(weight.detach()))
    assert forward._packed.num_bytes > 0
    forward.release()  # update_weights copies through .data (no version bump): release drops every copy
    assert forward._packed.num_bytes == 0
