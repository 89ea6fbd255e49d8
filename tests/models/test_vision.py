"""Vision-language models: the tiny Qwen2-VL, its processor, image-token expansion and M-RoPE position ids."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from hybridflow.models import build_causal_lm, load_tokenizer, save_tiny_model
from hybridflow.models.tiny_vlm import build_tiny_vlm
from hybridflow.models.vision import (
    VisionProcessor,
    check_vision_language_support,
    compute_mrope_position_ids,
    concat_multi_modal_inputs,
    load_processor,
    multi_modal_model_inputs,
)

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
TWO_IMAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Left:"}, {"type": "image"}, {"type": "text", "text": "Right:"}, {"type": "image"},
    {"type": "text", "text": "Same color?"},
]}]


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    return build_causal_lm(tiny_vlm_dir).eval(), load_processor(tiny_vlm_dir)


def left_pad(ids: list[int], length: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([pad] * (length - len(ids)) + ids),
            torch.tensor([0] * (length - len(ids)) + [1] * len(ids)))


def test_tiny_vlm_builds_fast_and_loads_back_by_path(tiny_vlm_dir, vlm):
    start = time.perf_counter()
    model, processor = build_tiny_vlm(seed=0, tokenizer=load_tokenizer(tiny_vlm_dir))
    assert time.perf_counter() - start < 10
    loaded, loaded_processor = vlm
    assert type(loaded).__name__ == "Qwen2VLForConditionalGeneration"
    assert loaded.config.text_config.num_hidden_layers == 2 and loaded.config.vision_config.depth == 1
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert isinstance(loaded_processor, VisionProcessor)
    assert loaded_processor.image_token_id == loaded.config.image_token_id
    assert loaded_processor.merge_size == loaded.config.vision_config.spatial_merge_size == 2
    assert loaded_processor.chat_template == processor.chat_template


def test_processor_expands_each_image_to_its_merged_patches(vlm):
    _, processor = vlm
    text = processor.apply_chat_template(TWO_IMAGES, add_generation_prompt=True)
    assert text.count("<|image_pad|>") == 2 and text.endswith("<|im_start|>assistant\n")
    small, wide = Image.new("RGB", (56, 56), "red"), Image.new("RGB", (112, 56), "blue")
    encoded = processor(text, [small, wide])
    assert encoded["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert encoded["pixel_values"].shape == (16 + 32, 3 * 2 * 14 * 14)
    assert encoded["input_ids"].count(processor.image_token_id) == 4 + 8
    assert encoded["raw_prompt_ids"].count(processor.image_token_id) == 2
    with pytest.raises(ValueError, match="2 image tokens but 1 images"):
        processor(text, [small])


def test_mrope_position_ids_equal_the_models_get_rope_index(vlm):
    model, processor = vlm
    pad = processor.tokenizer.pad_token_id
    rows = [(QUESTION, [Image.new("RGB", (56, 56), "red")]),
            (TWO_IMAGES, [Image.new("RGB", (84, 56), "red"), Image.new("RGB", (56, 112), "green")])]
    encoded = [processor(processor.apply_chat_template(m, add_generation_prompt=True), imgs) for m, imgs in rows]
    length = max(len(e["input_ids"]) for e in encoded) + 3
    ids, masks = zip(*(left_pad(e["input_ids"], length, pad) for e in encoded))
    input_ids, attention_mask = torch.stack(ids), torch.stack(masks)
    grids = torch.cat([e["image_grid_thw"] for e in encoded])
    expected, _ = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == processor.image_token_id).int(), image_grid_thw=grids,
        attention_mask=attention_mask,
    )
    for row, e in enumerate(encoded):
        ours = compute_mrope_position_ids(input_ids[row], attention_mask[row], e["image_grid_thw"],
                                          image_token_id=processor.image_token_id, spatial_merge_size=2)
        assert torch.equal(ours, expected[:, row]), row
    assert not torch.equal(expected[0], expected[1]), "images give the rows different M-RoPE positions"


def test_mrope_refuses_grids_that_do_not_fit_the_tokens():
    ids, mask = torch.tensor([5, 9, 9, 9, 9, 6]), torch.ones(6, dtype=torch.long)
    with pytest.raises(ValueError, match="image_grid_thw has 2 images but the sequence holds 1"):
        compute_mrope_position_ids(ids, mask, torch.tensor([[1, 4, 4], [1, 4, 4]]), image_token_id=9,
                                   spatial_merge_size=2)
    with pytest.raises(ValueError, match="cut off"):
        compute_mrope_position_ids(ids[:4], mask[:4], torch.tensor([[1, 4, 4]]), image_token_id=9,
                                   spatial_merge_size=2)
    text_only = compute_mrope_position_ids(torch.tensor([0, 5, 6]), torch.tensor([0, 1, 1]), None,
                                           image_token_id=9, spatial_merge_size=2)
    assert text_only.tolist() == [[0, 0, 1]] * 3


def test_multi_modal_inputs_concatenate_in_row_order():
    a = {"pixel_values": torch.zeros(4, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    b = {"pixel_values": torch.ones(8, 2), "image_grid_thw": torch.tensor([[1, 2, 4]])}
    merged = concat_multi_modal_inputs([a, None, b])
    assert merged["pixel_values"].shape == (12, 2) and merged["pixel_values"][4:].eq(1).all()
    assert merged["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    inputs = multi_modal_model_inputs([a, b], torch.tensor([[3, 9, 4], [9, 9, 1]]), image_token_id=9)
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 0], [1, 1, 0]]
    assert multi_modal_model_inputs([None, {}], torch.zeros(2, 3), image_token_id=9) == {}


def test_text_models_have_no_processor_and_other_vlms_are_refused(tmp_path):
    assert load_processor(save_tiny_model(tmp_path / "llama", seed=0)) is None
    idefics = SimpleNamespace(model_type="idefics3", vision_config=object())
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path: vision-language model_type 'idefics3'"):
        check_vision_language_support(idefics, "actor_rollout_ref.model.path")
    check_vision_language_support(SimpleNamespace(model_type="llama"), "x")  # text models pass
