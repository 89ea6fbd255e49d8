"""`build_rollout_output`: the one rollout layout, for engine-style and agent-style (tool token) responses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.engines.logprob import compute_log_probs_from_logits, pack_sequences, unpack_sequences
from hybridflow.engines.rollout.output import build_rollout_output
from hybridflow.models import build_tiny_model

PAD = 0
PROMPT_IDS = torch.tensor([[0, 0, 11, 12], [13, 14, 15, 16]])
PROMPT_MASK = (PROMPT_IDS != PAD).long()
PROMPT_POS = (PROMPT_MASK.cumsum(-1) - 1).clamp(min=0)  # verl's left-padded positions: [0, 0, 0, 1], [0, 1, 2, 3]


def agent_rows() -> dict[str, torch.Tensor]:
    """Row 0: model, tool, tool, model, then pad; row 1: model tokens only, with junk after its end."""
    return {
        "responses": torch.tensor([[5, 31, 32, 6, 77], [7, 8, 9, 99, 99]]),
        "attention": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
        "response_mask": torch.tensor([[1, 0, 0, 1, 0], [1, 1, 1, 0, 0]]),
        "log_probs": torch.tensor([[-1.0, -9.0, -9.0, -2.0, -9.0], [-0.5, -0.25, -0.125, -9.0, -9.0]]),
    }


def build_agent_output(**kwargs):
    rows = agent_rows()
    return build_rollout_output(
        PROMPT_IDS, PROMPT_MASK, PROMPT_POS, rows["responses"], rows["response_mask"], rows["log_probs"], PAD,
        attention_response_mask=rows["attention"], **kwargs,
    )


def test_engine_style_layout():
    """Without an attention mask for the response, `response_mask` is the attention (every token sampled)."""
    rows = agent_rows()
    out = build_rollout_output(
        PROMPT_IDS, PROMPT_MASK, PROMPT_POS, rows["responses"], rows["attention"], rows["log_probs"], PAD
    )
    batch = out.batch
    assert batch["prompts"].shape == (2, 4) and batch["responses"].shape == batch["response_mask"].shape == (2, 5)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape == (2, 9)
    assert batch["responses"].tolist() == [[5, 31, 32, 6, PAD], [7, 8, 9, PAD, PAD]]
    assert torch.equal(batch["input_ids"], torch.cat([PROMPT_IDS, batch["responses"]], dim=1))
    assert torch.equal(batch["attention_mask"][:, 4:], batch["response_mask"])
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert batch["rollout_log_probs"].tolist() == [[-1.0, -9.0, -9.0, -2.0, 0.0], [-0.5, -0.25, -0.125, 0.0, 0.0]]
    assert out.non_tensor_batch == {} and out.meta_info == {}


def test_agent_style_layout_attends_tool_tokens_and_trains_on_model_tokens():
    turns = np.array([3, 1])
    out = build_agent_output(non_tensor={"__num_turns__": turns}, meta_info={"global_steps": 2})
    batch = out.batch
    assert batch["attention_mask"][:, 4:].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 0, 0, 1, 0], [1, 1, 1, 0, 0]]
    assert batch["responses"].tolist() == [[5, 31, 32, 6, PAD], [7, 8, 9, PAD, PAD]]
    # Tool tokens and padding get log-prob 0; positions continue over every real token, tool tokens included.
    assert batch["rollout_log_probs"].tolist() == [[-1.0, 0.0, 0.0, -2.0, 0.0], [-0.5, -0.25, -0.125, 0.0, 0.0]]
    real_positions = batch["position_ids"][batch["attention_mask"].bool()]
    assert real_positions.tolist() == [0, 1, 2, 3, 4, 5] + [0, 1, 2, 3, 4, 5, 6]
    assert list(out.non_tensor_batch["__num_turns__"]) == [3, 1] and out.meta_info == {"global_steps": 2}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention": torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0]])}, "right-padded"),
        ({"response_mask": torch.tensor([[1, 0, 0, 1, 1], [1, 1, 1, 0, 0]])}, "does not attend"),
        ({"log_probs": torch.zeros(2, 4)}, "share one shape"),
    ],
)
def test_inconsistent_inputs_are_refused(change, message):
    rows = {**agent_rows(), **change}
    with pytest.raises(ValueError, match=message):
        build_rollout_output(
            PROMPT_IDS, PROMPT_MASK, PROMPT_POS, rows["responses"], rows["response_mask"], rows["log_probs"], PAD,
            attention_response_mask=rows["attention"],
        )


def test_agent_positions_give_the_training_engines_log_probs():
    """Both forwards of the FSDP engine (padded: ids, attention mask and positions; packed: `pack_sequences`)
    score an agent output's real response tokens as one unpadded forward of each trajectory does."""
    model, _ = build_tiny_model(seed=3)
    out = build_agent_output().batch
    ids, mask, pos = out["input_ids"], out["attention_mask"], out["position_ids"]
    attended = out["attention_mask"][:, 4:].bool()
    with torch.no_grad():
        padded_logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        padded = compute_log_probs_from_logits(padded_logits[:, 3:-1], ids[:, 4:])
        packed_ids, packed_pos, keep = pack_sequences(ids, mask, pos)
        packed_logits = model(input_ids=packed_ids, position_ids=packed_pos, use_cache=False).logits[0]
        packed_all = compute_log_probs_from_logits(packed_logits, torch.roll(packed_ids[0], -1))
        packed = unpack_sequences(packed_all, keep)[:, 3:-1]
        for row in range(ids.size(0)):
            real = ids[row][mask[row].bool()]
            logits = model(input_ids=real[None], use_cache=False).logits[0]
            reference = compute_log_probs_from_logits(logits[:-1], real[1:])[-int(attended[row].sum()) :]
            torch.testing.assert_close(padded[row][attended[row]], reference, atol=1e-5, rtol=0)
            torch.testing.assert_close(packed[row][attended[row]], reference, atol=1e-5, rtol=0)
