"""A tiny randomly initialised Qwen2-VL (one vision block, 2 text layers) with its processor, built in seconds.

It is a real `Qwen2VLForConditionalGeneration` (vision tower, patch merger, M-RoPE), only small: tests and smoke
runs exercise the same code paths a Qwen2-VL checkpoint dropped in by path takes. The tokenizer is the tiny
text model's (`build_tiny_tokenizer`) extended with Qwen2-VL's vision tokens and a chat template that renders
image entries; the image processor is Qwen2-VL's (PIL backend) with 14-pixel patches merged 2x2, so a 56x56
image becomes 4 image tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.models.chat_template import VISION_CHATML_TEMPLATE, VISION_SPECIAL_TOKENS
from hybridflow.models.loader import prepare_tokenizer
from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.models.vision import VisionProcessor

__all__ = ["build_tiny_vlm", "build_tiny_vlm_tokenizer", "save_tiny_vlm"]

PATCH_SIZE = 14
MERGE_SIZE = 2


def build_tiny_vlm_tokenizer(tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedTokenizerBase:
    """`tokenizer` (default `build_tiny_tokenizer()`) with the vision tokens added and the vision chat template."""
    tokenizer = prepare_tokenizer(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    missing = [token for token in VISION_SPECIAL_TOKENS if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.chat_template = VISION_CHATML_TEMPLATE
    return tokenizer


def build_tiny_vlm(
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate: int = 128,
    vision_depth: int = 1,
    vision_dim: int = 32,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, VisionProcessor]:
    """A small random `Qwen2VLForConditionalGeneration` (float32, sdpa) and its `VisionProcessor`.

    The same `seed` gives the same weights; the global torch RNG is left untouched. The head dimension
    (hidden / num_heads) must be even: M-RoPE splits its half into temporal, height and width sections.
    """
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig, Qwen2VLImageProcessorPil

    tokenizer = build_tiny_vlm_tokenizer(tokenizer)
    half_head = hidden // num_heads // 2
    height = width = half_head // 3 + (1 if half_head % 3 else 0)
    mrope_section = [half_head - height - width, height, width]
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=1024, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden, num_heads=2, mlp_ratio=2,
            patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, in_channels=3,
        ),
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2,
        min_pixels=(PATCH_SIZE * MERGE_SIZE) ** 2, max_pixels=(4 * PATCH_SIZE * MERGE_SIZE) ** 2,
    )
    return model, VisionProcessor(image_processor, tokenizer, VISION_CHATML_TEMPLATE)


def save_tiny_vlm(path: str | os.PathLike, num_layers: int = 2, hidden: int = 64, seed: int = 0,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """Build `build_tiny_vlm(num_layers, hidden, seed=seed)` and save model, tokenizer and image processor to
    `path`; workers then load it by path like any checkpoint (`build_causal_lm`, `load_processor`)."""
    model, processor = build_tiny_vlm(num_layers=num_layers, hidden=hidden, seed=seed, tokenizer=tokenizer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
