"""Sparse upcycling: the Mixtral computes the dense model's function, trains its experts apart, and refuses what it
cannot copy."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import build_tiny_model
from hybridflow.models.upcycle import main, upcycle_to_mixtral


@pytest.fixture(scope="module")
def dense():
    model, tokenizer = build_tiny_model("llama", num_layers=2, hidden=64, seed=0)
    return model.eval(), tokenizer


def test_the_upcycled_mixtral_gives_the_dense_logits(dense):
    model, _ = dense
    moe = upcycle_to_mixtral(model, num_experts=4, top_k=2, seed=0)
    assert moe.config.model_type == "mixtral" and moe.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = model(ids).logits, moe(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # the router is not trivial: tokens spread over the experts, and the seed fixes it
    routers = [layer.mlp.gate.weight for layer in moe.model.layers]
    assert all(float(weight.std()) > 0.01 for weight in routers)
    again = upcycle_to_mixtral(model, num_experts=4, top_k=2, seed=0)
    assert torch.equal(again.model.layers[1].mlp.gate.weight, routers[1])


def test_one_training_step_moves_the_experts_apart(dense):
    model, _ = dense
    moe = upcycle_to_mixtral(model, num_experts=4, top_k=2, router_std=0.5, seed=1).train()
    ids = torch.randint(3, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    moe(ids, labels=ids).loss.backward()
    grads = moe.model.layers[0].mlp.experts.down_proj.grad
    assert not torch.allclose(grads[0], grads[1]), "experts get different gradients once routing differs"


def test_what_cannot_be_copied_is_refused(dense, tmp_path):
    model, tokenizer = dense
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        upcycle_to_mixtral(model, num_experts=4, top_k=5)
    qwen, _ = build_tiny_model("qwen2", num_layers=1, hidden=64)
    with pytest.raises(ValueError, match="model of type .*got 'qwen2'"):
        upcycle_to_mixtral(qwen)
    source = tmp_path / "dense"
    from hybridflow.models.loader import save_model_and_tokenizer

    save_model_and_tokenizer(model, tokenizer, source)
    target = tmp_path / "moe"
    assert (main(["--model", str(source), "--target_dir", str(target)]) / "config.json").is_file()
    with pytest.raises(SystemExit, match="not empty"):
        main(["--model", str(source), "--target_dir", str(target)])
