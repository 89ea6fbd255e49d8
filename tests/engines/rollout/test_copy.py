"""The rollout's own copy of the model: its dtype (rollout.dtype) and its buffers taken from the actor's module."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout.base import copy_buffers, copy_named_tensors
from hybridflow.models.loader import resolve_dtype
from hybridflow.models import build_causal_lm


def test_auto_dtype_is_bf16_on_accelerators_and_fp32_on_cpu():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_an_empty_copy_with_the_actors_buffers_and_weights_equals_the_loaded_model(tiny_llama_dir):
    loaded = build_causal_lm(tiny_llama_dir)
    copy = build_causal_lm(tiny_llama_dir, empty=True).to_empty(device="cpu")
    copy.tie_weights()
    assert copy_buffers(copy, loaded) == len(list(loaded.buffers())) > 0  # rotary frequencies
    copy_named_tensors(copy, loaded.named_parameters())  # the hand-over: tied weights once
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        assert torch.equal(copy(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_a_buffer_the_source_lacks_is_an_error(tiny_llama_dir):
    copy = build_causal_lm(tiny_llama_dir, empty=True).to_empty(device="cpu")
    with pytest.raises(KeyError, match="inv_freq"):
        copy_buffers(copy, torch.nn.Linear(2, 2))
