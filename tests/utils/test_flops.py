"""Model FLOPs and MFU (`hybridflow.utils.flops`): hand-computed counts, and the sizes read from real modules."""

from __future__ import annotations

import pytest

from hybridflow.models import build_tiny_model
from hybridflow.utils.flops import (
    ModelFlopsShape,
    compute_mfu,
    compute_model_flops,
    model_flops_shape,
    sequence_attention_pairs,
)

SHAPE = ModelFlopsShape(matmul_params=1000, head_params=300, num_layers=2, num_heads=4, head_dim=8)


def test_model_flops_of_a_forward_and_of_an_update_by_hand():
    # sequences of 3 and 5 tokens, 4 of them projected to the vocabulary:
    # dense 2 x 1000 x 8 = 16,000; attention 4 x 2 x 4 x 8 x (9 + 25) = 8,704; head 2 x 300 x 4 = 2,400
    pairs = sequence_attention_pairs([3, 5])
    assert pairs == 34
    assert compute_model_flops(SHAPE, 8, pairs, 4, backward=False) == 16_000 + 8_704 + 2_400
    assert compute_model_flops(SHAPE, 8, pairs, 4, backward=True) == 3 * (16_000 + 8_704 + 2_400)
    assert compute_model_flops(SHAPE, 0, 0, 0, backward=True) == 0


def test_mfu_divides_by_time_and_peak():
    assert compute_mfu(6e12, 2.0, 10e12) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="seconds"):
        compute_mfu(1.0, 0.0, 1.0)


def test_shape_of_a_tied_llama_counts_the_head_once_and_not_the_embedding_lookup():
    model, tokenizer = build_tiny_model("llama", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, intermediate=128)
    shape = model_flops_shape(model)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3  # q, o; k, v (2 kv heads x 16); gate, up, down
    assert shape == ModelFlopsShape(
        matmul_params=2 * per_layer, head_params=len(tokenizer) * 64, num_layers=2, num_heads=4, head_dim=16
    )
    # all parameters = matmul + head (tied with the embedding) + the norms
    assert sum(p.numel() for p in model.parameters()) == shape.matmul_params + shape.head_params + 64 * 5


def test_shape_of_an_untied_model_and_of_a_value_model(tmp_path):
    from hybridflow.models import save_tiny_model
    from hybridflow.models.value_head import build_value_model

    untied, tokenizer = build_tiny_model("qwen2", num_layers=1, hidden=32, num_heads=2, num_kv_heads=1,
                                         intermediate=64, tie_word_embeddings=False)
    shape = model_flops_shape(untied)
    assert shape.head_params == len(tokenizer) * 32  # the separate input embedding is not a matmul
    value = build_value_model(save_tiny_model(tmp_path, arch="llama", num_layers=2, hidden=64))
    value_shape = model_flops_shape(value)
    causal = model_flops_shape(build_tiny_model("llama", num_layers=2, hidden=64)[0])
    assert value_shape.head_params == 0
    assert value_shape.matmul_params == causal.matmul_params + 64  # the value head: hidden x 1, at every token
