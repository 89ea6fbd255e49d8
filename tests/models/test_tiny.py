"""Tiny models, tokenizers and the loader."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import (
    CHATML_TEMPLATE,
    build_causal_lm,
    build_tiny_model,
    load_model_and_tokenizer,
    prepare_tokenizer,
    save_tiny_model,
    to_torch_dtype,
)
from hybridflow.models.loader import split_model_location


def test_local_tokenizer_encodes_anything_and_has_chatml(local_tokenizer):
    text = "Hello wörld 12+7 = 19 ####"
    assert local_tokenizer.decode(local_tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "hi"}]
    chat = local_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert local_tokenizer.pad_token == local_tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_is_seeded_and_leaves_global_rng_alone(arch, local_tokenizer):
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    a, _ = build_tiny_model(arch, seed=1, tokenizer=local_tokenizer)
    assert torch.equal(torch.rand(1), expected_next)
    b, _ = build_tiny_model(arch, seed=1, tokenizer=local_tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 64
    assert a.config.vocab_size == len(local_tokenizer)


def test_save_and_load_by_path(tmp_path, local_tokenizer):
    path = save_tiny_model(tmp_path / "tiny", arch="qwen2", seed=2, tokenizer=local_tokenizer)
    model, tokenizer = load_model_and_tokenizer(path)
    original, _ = build_tiny_model("qwen2", seed=2, tokenizer=local_tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits)
    assert tokenizer.chat_template == local_tokenizer.chat_template
    assert build_causal_lm(str(path), dtype="bf16").lm_head.weight.dtype == torch.bfloat16


def test_split_model_location_and_dtypes(tmp_path):
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"")
    assert split_model_location(gguf) == (str(tmp_path), "model.Q4.gguf")
    assert split_model_location(tmp_path) == (str(tmp_path), None)
    assert to_torch_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        to_torch_dtype("int3")


def test_prepare_tokenizer_fills_pad_and_template(local_tokenizer):
    import copy

    tokenizer = copy.deepcopy(local_tokenizer)
    tokenizer.pad_token = None
    tokenizer.chat_template = None
    prepare_tokenizer(tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token
    assert tokenizer.chat_template == CHATML_TEMPLATE
