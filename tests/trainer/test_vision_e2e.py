"""GRPO on a tiny Qwen2-VL and the color_square image task, on 2 Ray workers, and its export; settings that cannot
carry images are refused before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.data.preprocess import color_square
from hybridflow.engines.training.merge import merge_checkpoint
from hybridflow.models import build_causal_lm
from hybridflow.models.tiny_vlm import save_tiny_vlm
from hybridflow.models.vision import load_processor
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.workers.weight_sync import digest_tensors
from tests.tiny_runs import REWARD_FILE, build_workspace
from tests.trainer.placement_runs import overrides, train


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """`data/{train,test}.parquet` of color_square rows, `tiny` a tiny Qwen2-VL, `reward.py` a length reward (the
    random model never names the colour, so the task's exact-match scorer would give every sample 0)."""
    root = tmp_path_factory.mktemp("vision")
    color_square.main(["--local_dir", str(root / "data"), "--train_size", "8", "--test_size", "2", "--seed", "0"])
    save_tiny_vlm(root / "tiny", seed=0)
    (root / "reward.py").write_text(REWARD_FILE)
    return root


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_grpo_steps_on_a_tiny_vlm_train_the_vision_tower_on_two_workers(workspace, ray_cluster):
    # use_remove_padding=True as verl's VL lines set it: the packed forward, whose log-probs must match the rollout's
    records, digests = train(overrides(workspace, workspace / "run", "actor_rollout_ref.rollout.name=hf",
                                      "actor_rollout_ref.model.use_remove_padding=True",
                                      "trainer.save_freq=2"))  # the step-2 checkpoint is exported below
    assert sorted(records) == [1, 2]
    for step in (1, 2):
        metrics = records[step]
        assert metrics["response_length/mean"] > 0 and metrics["actor/grad_norm"] > 0
        # The rollout generated with the images and M-RoPE positions that training scores the tokens with.
        assert metrics["training/rollout_probs_diff_max"] < 1e-5
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/score/mean"):
            assert abs(metrics[key]) < 1e6, key
    (start, _), (end, _) = digests
    changed = {name for name in start if start[name] != end[name]}
    assert any(name.startswith("model.visual.") for name in changed), "the vision tower was trained"
    assert any(name.startswith("model.language_model.") for name in changed)

    # The last checkpoint exports to a plain HF directory that loads back with its image processor.
    exported = merge_checkpoint(workspace / "run" / "global_step_2", workspace / "export")
    assert load_processor(exported) is not None
    assert digest_tensors(build_causal_lm(exported).named_parameters()) == end


VLM = r"actor_rollout_ref.model.path=.* is a vision-language model \(qwen2_vl\); "


@pytest.mark.parametrize(("extra", "match"), [
    ("actor_rollout_ref.rollout.name=native", VLM + r"actor_rollout_ref.rollout.name='native' does not run "
                                              r"vision-language models .*one of \['hf'\]"),
    ("actor_rollout_ref.rollout.name=vllm", r"actor_rollout_ref.rollout.name='vllm'"),
    ("actor_rollout_ref.actor.use_prefix_grouper=True", VLM + r"actor_rollout_ref.actor.use_prefix_grouper=True"),
    ("actor_rollout_ref.rollout.mode=async data.return_raw_chat=True", VLM + r"actor_rollout_ref.rollout.mode='async'"),
    ("algorithm.adv_estimator=gae", VLM + r"algorithm.adv_estimator='gae' \(critic.enable\): a critic"),
])
def test_settings_that_cannot_carry_images_are_refused_before_ray(workspace, extra, match):
    args = overrides(workspace, workspace / "refused", "actor_rollout_ref.rollout.name=hf", *extra.split())
    config = load_config(args)
    with pytest.raises(ValueError, match=match):
        validate_config(config)


def test_a_text_model_refuses_image_rows(workspace, tmp_path):
    text_model = build_workspace(tmp_path, train_size=4, test_size=1)
    args = overrides(workspace, workspace / "text", f"actor_rollout_ref.model.path={text_model / 'tiny'}")
    with pytest.raises(ValueError, match=r"data.train_files entry .*train.parquet': column 'images' \(data.image_key\) "
                                         "holds images but actor_rollout_ref.model.path=.* is a text-only model"):
        validate_config(load_config(args))
