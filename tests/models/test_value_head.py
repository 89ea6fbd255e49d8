"""Value-head models and the score helpers."""

from __future__ import annotations

import torch

from hybridflow.models import (
    build_causal_lm,
    build_value_model,
    compute_sequence_scores,
    compute_token_level_scores,
    save_tiny_model,
)


def test_value_model_reuses_backbone_and_is_deterministic(tmp_path, local_tokenizer):
    path = save_tiny_model(tmp_path / "tiny", seed=3, tokenizer=local_tokenizer)
    causal = build_causal_lm(path)
    value, again = build_value_model(path), build_value_model(path)
    assert type(value).__name__ == "LlamaForTokenClassification"
    causal_sd = causal.state_dict()
    for name, tensor in value.model.state_dict().items():
        assert torch.equal(tensor, causal_sd[f"model.{name}"])
    assert torch.equal(value.score.weight, again.score.weight)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad():
        out = value(input_ids=ids, use_cache=False).logits
    assert out.shape == (2, 3, 1)


def test_sequence_and_token_level_scores_by_hand():
    token_scores = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    assert compute_sequence_scores(token_scores, mask).tolist() == [3.0, 8.0]
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = compute_token_level_scores(torch.tensor([0.5, 1.0, 2.0]), response_mask)
    assert out.tolist() == [[0.0, 0.5, 0.0], [0.0, 0.0, 1.0], [2.0, 0.0, 0.0]]
