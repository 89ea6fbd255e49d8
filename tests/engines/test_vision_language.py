"""A tiny Qwen2-VL through the engines: FSDP log-probs and updates with images, `hf` rollout with images."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from hybridflow.data import RLHFDataConfig, RLHFDataset, collate_fn
from hybridflow.engines.logprob import compute_response_position_ids
from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.models import build_causal_lm, load_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.models.vision import concat_multi_modal_inputs, load_processor
from hybridflow.protocol import DataProto
from tests.engines.helpers import seq_mean_nll

RESPONSE_LEN = 6
# Images of different sizes: 4, 8 and 2x4 image tokens, so rows carry different numbers of pixel patches.
IMAGES = [[(56, 56)], [(112, 56)], [(56, 56), (56, 56)]]


def png(size: tuple[int, int], seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def prompts(tiny_vlm_dir, tmp_path_factory) -> DataProto:
    rows = [{
        "data_source": "color_square", "ability": "vision", "reward_model": {"ground_truth": "red"},
        "prompt": [{"role": "user", "content": "<image>" * len(sizes) + f"Question {i}: what color?"}],
        "images": [{"bytes": png(size, seed=10 * i + j)} for j, size in enumerate(sizes)],
    } for i, sizes in enumerate(IMAGES)]
    path = tmp_path_factory.mktemp("vlm_rows") / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = RLHFDataset(path, load_tokenizer(tiny_vlm_dir), RLHFDataConfig(max_prompt_length=40),
                          processor=load_processor(tiny_vlm_dir))
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    return batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"],
                        non_tensor_batch_keys=["multi_modal_inputs"])


def with_responses(prompts: DataProto, seed: int = 0) -> DataProto:
    """Prompts + random right-padded responses, in the rollout's layout (M-RoPE positions continued)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(prompts)
    responses = torch.randint(10, 1000, (bs, RESPONSE_LEN), generator=gen)
    response_mask = (torch.arange(RESPONSE_LEN) < torch.tensor([[RESPONSE_LEN], [3], [5]])).long()
    tensors = {
        "input_ids": torch.cat([prompts.batch["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([prompts.batch["attention_mask"], response_mask], dim=1),
        "position_ids": torch.cat([prompts.batch["position_ids"], compute_response_position_ids(
            prompts.batch["position_ids"], RESPONSE_LEN)], dim=-1),
        "responses": responses,
        "response_mask": response_mask,
    }
    return DataProto.from_dict(tensors, non_tensors=dict(prompts.non_tensor_batch))


def direct_log_probs(model, batch: DataProto) -> torch.Tensor:
    """HF forward of the whole batch (the model computes its own M-RoPE positions) -> response log-probs."""
    ids = batch.batch["input_ids"]
    images = concat_multi_modal_inputs(list(batch.non_tensor_batch["multi_modal_inputs"]))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch.batch["attention_mask"], **images,
                       mm_token_type_ids=(ids == model.config.image_token_id).int()).logits
    logits = logits[:, -RESPONSE_LEN - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)


def test_engine_log_probs_equal_a_direct_hf_forward_whatever_the_micro_batches(tiny_vlm_dir, prompts):
    batch = with_responses(prompts)
    expected = direct_log_probs(build_causal_lm(tiny_vlm_dir).eval(), batch)
    engine = build_fsdp_engine(tiny_vlm_dir, FSDPEngineConfig(micro_batch_size_per_gpu=1))
    mask = batch.batch["response_mask"].bool()
    for kwargs in ({"micro_batch_size": 1}, {"micro_batch_size": 3}, {"max_token_len": 60}):
        log_probs, entropy = engine.compute_log_prob(batch, calculate_entropy=True, **kwargs)
        torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-5, rtol=0, msg=str(kwargs))
        assert entropy.shape == expected.shape
    # A row's pixels must travel with it: swapping two rows' images changes their log-probs.
    swapped = with_responses(prompts)
    swapped.non_tensor_batch["multi_modal_inputs"] = swapped.non_tensor_batch["multi_modal_inputs"][[1, 0, 2]]
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        engine.compute_log_prob(swapped, micro_batch_size=1)


def test_engine_update_trains_the_vision_tower(tiny_vlm_dir, prompts):
    engine = build_fsdp_engine(tiny_vlm_dir, FSDPEngineConfig(micro_batch_size_per_gpu=2))
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    metrics = engine.train_batch(with_responses(prompts), seq_mean_nll)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    changed = {name for name, p in engine.module.named_parameters() if not torch.equal(p, before[name])}
    assert any(name.startswith("model.visual.") for name in changed)
    assert any(name.startswith("model.language_model.") for name in changed)


def test_packed_forward_and_update_equal_the_padded_ones(tiny_vlm_dir, prompts):
    """use_remove_padding=True (verl's VL lines set it): the rows' real tokens packed into one row, with their
    M-RoPE positions and images, give the padded forward's log-probs and the same update."""
    batch = with_responses(prompts)
    expected = direct_log_probs(build_causal_lm(tiny_vlm_dir).eval(), batch)
    mask = batch.batch["response_mask"].bool()
    engines = {}
    for name, packed in (("padded", False), ("packed", True)):
        torch.manual_seed(0)
        engines[name] = build_fsdp_engine(tiny_vlm_dir, FSDPEngineConfig(
            micro_batch_size_per_gpu=3, model=ModelConfig(use_remove_padding=packed)))
    for kwargs in ({"micro_batch_size": 1}, {"micro_batch_size": 3}, {"max_token_len": 60}):
        log_probs, _ = engines["packed"].compute_log_prob(batch, calculate_entropy=True, **kwargs)
        torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-5, rtol=0, msg=str(kwargs))
    steps = {name: engine.train_batch(with_responses(prompts), seq_mean_nll) for name, engine in engines.items()}
    assert steps["packed"]["loss"] == pytest.approx(steps["padded"]["loss"], abs=1e-5)
    assert steps["packed"]["grad_norm"] == pytest.approx(steps["padded"]["grad_norm"], rel=1e-4)
    padded_params = dict(engines["padded"].module.named_parameters())
    for name, param in engines["packed"].module.named_parameters():
        torch.testing.assert_close(param, padded_params[name], atol=1e-5, rtol=0, msg=name)


def test_a_frozen_vision_tower_keeps_its_weights_while_the_language_model_trains(tiny_vlm_dir, prompts):
    """verl's actor.freeze_vision_tower: the tower takes no gradient and no optimizer state."""
    engine = build_fsdp_engine(tiny_vlm_dir, FSDPEngineConfig(micro_batch_size_per_gpu=2, freeze_vision_tower=True))
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    metrics = engine.train_batch(with_responses(prompts), seq_mean_nll)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    changed = {name for name, p in engine.module.named_parameters() if not torch.equal(p, before[name])}
    assert not any(name.startswith("model.visual.") for name in changed)
    assert any(name.startswith("model.language_model.") for name in changed)
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for name, p in engine.module.named_parameters() if name.startswith("model.visual."))


def test_hf_rollout_greedy_equals_hf_generate_and_keeps_images_and_mrope_positions(tiny_vlm_dir, prompts):
    model = build_causal_lm(tiny_vlm_dir).eval()
    tokenizer = load_tokenizer(tiny_vlm_dir)
    rollout = HFRollout(model, tokenizer, SamplingParams(max_new_tokens=RESPONSE_LEN, do_sample=False))
    out = rollout.generate_sequences(prompts)

    ids = prompts.batch["input_ids"]
    images = concat_multi_modal_inputs(list(prompts.non_tensor_batch["multi_modal_inputs"]))
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=prompts.batch["attention_mask"], **images,
            mm_token_type_ids=(ids == model.config.image_token_id).int(), do_sample=False,
            max_new_tokens=RESPONSE_LEN, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )[:, ids.size(1):]
    mask = out.batch["response_mask"].bool()
    assert mask.all(), "the seeded random model writes no eos in 6 tokens: every token is compared"
    assert torch.equal(out.batch["responses"], expected)
    prompt_len = ids.size(1)
    positions = out.batch["position_ids"]
    assert positions.shape == (3, 4, prompt_len + RESPONSE_LEN)
    assert torch.equal(positions[..., :prompt_len], prompts.batch["position_ids"])
    assert torch.equal(positions[..., prompt_len:], prompts.batch["position_ids"][..., -1:] + torch.arange(1, 7))
    kept = out.non_tensor_batch["multi_modal_inputs"]
    assert [r["image_grid_thw"].tolist() for r in kept] == [[[1, 4, 4]], [[1, 4, 8]], [[1, 4, 4], [1, 4, 4]]]

    # The training engine scores the rollout's tokens with the stored M-RoPE positions as generate sampled them.
    engine = build_fsdp_engine(tiny_vlm_dir, FSDPEngineConfig(micro_batch_size_per_gpu=2))
    log_probs, _ = engine.compute_log_prob(out)
    torch.testing.assert_close(log_probs[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)

    sampled = HFRollout(model, tokenizer, SamplingParams(max_new_tokens=4, temperature=1.0, n=2))
    repeated = sampled.generate_sequences(prompts)
    assert len(repeated) == 6 and repeated.batch["position_ids"].shape == (6, 4, prompt_len + 4)
    assert [len(r["image_grid_thw"]) for r in repeated.non_tensor_batch["multi_modal_inputs"]] == [1, 1, 1, 1, 2, 2]
