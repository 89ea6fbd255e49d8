"""End to end on local Ray with 2 CPU workers and a tiny model: GRPO, validation, checkpoint, resume, PPO+GAE.

This is the real-training test that runs on every CI run (not marked slow): it goes through the same
`run_ppo` path as `hybridflow train`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridflow.trainer.checkpoint_dirs import LATEST_FILE, list_steps
from tests.helpers import nothing_started
from tests.tiny_runs import start_from_checkpoint
from tests.trainer.e2e_runs import GRPO, by_step, overrides, run, workspace  # noqa: F401  (fixtures)


def test_grpo_trains_validates_checkpoints_and_resumes_exactly(workspace):
    full_dir = workspace / "full"
    dumps = (f"trainer.rollout_data_dir={full_dir / 'rollouts'}", f"trainer.validation_data_dir={full_dir / 'val'}")
    full = by_step(run(overrides(workspace, full_dir, *GRPO, *dumps)))
    assert sorted(full) == [0, 1, 2, 3]
    assert "val-core/reasoning_gym/basic_arithmetic/acc/mean@1" in full[0]  # validation before training
    assert "val-core/reasoning_gym/basic_arithmetic/acc/mean@1" in full[3]  # and after the last step
    for step in (1, 2, 3):
        record = full[step]
        assert record["actor/grad_norm"] > 0, "non-zero advantages must give gradients"
        assert record["critic/advantages/max"] > 0 and record["response_length/mean"] > 0
        for key in ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "timing_s/gen",
                    "timing_s/old_log_prob", "training/rollout_probs_diff_mean", "timing_s/update_actor",
                    "timing_s/update_weights", "perf/throughput", "perf/tokens_per_s/update_actor",
                    "perf/tokens_per_s/gen", "perf/max_memory_allocated_gb"):
            assert key in record, key
        # model FLOPs over the measured peak: a tiny model uses a small share of it, never more than all
        for stage in ("actor", "actor_infer", "ref"):
            assert 0 < record[f"perf/mfu/{stage}"] < 1, (stage, record[f"perf/mfu/{stage}"])
        assert record["perf/max_memory_allocated_gb"] > 0.1  # the peak RSS of a worker process
    assert full[3]["actor/kl_loss"] > 0, "the policy moved away from the reference"
    assert list_steps(full_dir) == [2, 3] and (full_dir / LATEST_FILE).read_text() == "3"
    assert (full_dir / "plots" / "reward.png").is_file()
    check_grpo_dumps(full_dir, steps=3, prompts=4, n=4, val_rows=4)

    # Resume from step 2 in a fresh directory: step 3 must reproduce the uninterrupted run.
    resumed_dir = start_from_checkpoint(full_dir / "global_step_2", workspace / "resumed")
    resumed = by_step(run(overrides(workspace, resumed_dir, *GRPO)))
    assert sorted(resumed) == [3], "resume starts after the checkpointed step, without re-validating"
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss",
                "actor/grad_norm", "val-core/reasoning_gym/basic_arithmetic/acc/mean@1"):
        assert resumed[3][key] == full[3][key], f"{key}: resumed {resumed[3][key]} vs uninterrupted {full[3][key]}"

    # What a resume restores rather than reads, changed, is refused before Ray starts: the shards' ranks (read from
    # the config) and the data order's rows (once the driver has built its data loader).
    shorter = workspace / "data" / "shorter.parquet"
    pq.write_table(pq.read_table(workspace / "data" / "train.parquet").slice(0, 12), shorter)
    refused = {
        "trainer.n_gpus_per_node=1": r"whose actor was written with world_size=2, this run uses 1: resume with the "
                                     r"same layout \(trainer.nnodes, trainer.n_gpus_per_node",
        f"data.train_files=[{shorter}]": r"data order was saved with num_samples=16 .*this run has num_samples=12; "
                                         r"resume with the same data.train_files",
    }
    for change, message in refused.items():
        with nothing_started(), pytest.raises(ValueError, match=message):
            run(overrides(workspace, resumed_dir, *GRPO, change))


def check_grpo_dumps(run_dir: Path, steps: int, prompts: int, n: int, val_rows: int) -> None:
    """verl's rollout and validation dumps: one line per sample, and what a broken GRPO would change: each prompt
    group's advantages are its scores whitened within the group, (s - mean) / (std + 1e-6)."""
    import torch

    assert sorted(path.name for path in (run_dir / "rollouts").iterdir()) == [f"{s}.jsonl" for s in range(1, steps + 1)]
    for step in range(1, steps + 1):
        rows = [json.loads(line) for line in (run_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == prompts * n and all(row["step"] == step and row["output"] for row in rows)
        assert {"input", "output", "gts", "score", "uid", "advantage"} <= set(rows[0])
        groups: dict[str, list[dict]] = {}
        for row in rows:
            groups.setdefault(row["uid"], []).append(row)
        assert sorted(len(group) for group in groups.values()) == [n] * prompts
        for group in groups.values():
            scores = torch.tensor([row["score"] for row in group], dtype=torch.float64)
            expected = (scores - scores.mean()) / (scores.std() + 1e-6)
            got = torch.tensor([row["advantage"] for row in group], dtype=torch.float64)
            assert torch.allclose(got, expected, atol=1e-4), (got.tolist(), scores.tolist())
    for step in (0, steps):
        rows = [json.loads(line) for line in (run_dir / "val" / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == val_rows and {"input", "output", "gts", "score", "step"} <= set(rows[0])


def test_ppo_with_gae_trains_a_critic(workspace):
    records = by_step(run(overrides(
        workspace, workspace / "ppo",
        "algorithm.adv_estimator=gae", "algorithm.lam=0.95", "actor_rollout_ref.rollout.n=1",
        # token-budget micro-batches for the actor, old log-probs and (by verl's interpolation) the critic
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
        "critic.ppo_max_token_len_per_gpu=300", "critic.forward_max_token_len_per_gpu=300",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        f"critic.model.path={workspace / 'tiny'}", "critic.ppo_mini_batch_size=2",
        "critic.ppo_micro_batch_size_per_gpu=1", "critic.optim.lr=1e-3",
        "trainer.total_training_steps=1", "trainer.val_before_train=False",
    )))
    step = records[1]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/vf_explained_var",
                "critic/returns/mean", "timing_s/values", "timing_s/update_critic", "actor/pg_loss"):
        assert key in step, key
    assert step["critic/grad_norm"] > 0 and step["critic/vf_loss"] > 0 and 0 <= step["critic/vf_clipfrac"] <= 1
    assert 0 < step["perf/mfu/critic"] < 1 and 0 < step["perf/mfu/actor"] < 1
    assert abs(step["critic/advantages/mean"]) < 1e-4, "GAE advantages are whitened over the response tokens"
    assert step["critic/values/max"] > step["critic/values/min"], "a fresh value head still varies per token"
    assert step["critic/returns/mean"] != step["critic/values/mean"], "returns carry the rewards"
    # verl's meaning of the defaults save_freq=-1 and test_freq=-1: no checkpoint, no validation during training
    assert list_steps(workspace / "ppo") == [] and not any(key.startswith("val-") for key in step)


@pytest.mark.slow  # the suite's time budget; the resampling itself is tests/algorithms/test_pf_ppo.py's
def test_ppo_with_pf_ppo_resamples_before_the_updates(workspace):
    records = by_step(run(overrides(
        workspace, workspace / "pf_ppo",
        "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=pow",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        f"critic.model.path={workspace / 'tiny'}", "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=1",
        "trainer.total_training_steps=1", "trainer.val_before_train=False",
    )))
    step = records[1]
    assert 0 < step["pf_ppo/unique_fraction"] <= 1 and "critic/vf_loss" in step and "actor/pg_loss" in step
    assert step["pf_ppo/score_mean_after"] >= 0  # pow weights favour large |score|; the tiny task scores 0 or 1


@pytest.mark.slow  # the suite's time budget; tests/workers/test_old_log_prob_sources.py covers the source choice
def test_on_policy_grpo_skips_the_old_log_prob_pass(workspace):
    """One epoch, one mini-batch: the update's own forward gives the old log-probs; entropy and the gap between
    the rollout's and the trainer's log-probs are still logged (here from shared-prompt forwards)."""
    records = by_step(run(overrides(
        workspace, workspace / "on_policy", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
        "actor_rollout_ref.actor.use_prefix_grouper=True",  # each prompt's 2 samples share one prompt forward
        "trainer.val_before_train=False", "data.val_files=[]",
    )))
    step = records[1]
    assert "timing_s/old_log_prob" not in step and step["actor/grad_norm"] > 0
    assert step["actor/entropy"] > 0 and step["training/rollout_probs_diff_max"] < 1e-2


# Validation runs in every CI run in test_grpo_trains_validates_checkpoints_and_resumes_exactly (steps 0 and 3).
@pytest.mark.slow
def test_val_only_validates_without_training(workspace):
    run_dir = workspace / "val_only"
    records = by_step(run(overrides(workspace, run_dir, "trainer.val_only=True", "trainer.n_gpus_per_node=1",
                                    "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2")))
    assert sorted(records) == [0]
    assert "val-core/reasoning_gym/basic_arithmetic/acc/mean@1" in records[0]
    assert list_steps(run_dir) == [], "nothing was trained, so nothing is saved"


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_reward_model_remax_and_dynamic_sampling_run_together(workspace):
    """Three dataflows in one GRPO-style run on Ray: a reward-model worker joined with the rule reward, ReMax's
    greedy baseline, and DAPO's dynamic sampling drawing generation batches of 4 prompts for steps of 2."""
    from hybridflow.models import save_tiny_reward_model

    rm_dir = workspace / "tiny_rm"
    if not rm_dir.exists():
        save_tiny_reward_model(rm_dir, num_layers=2, hidden=64, seed=5)
    records = by_step(run(overrides(
        workspace, workspace / "dataflows", "algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=2", "data.gen_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "reward_model.enable=True", f"reward_model.model.path={rm_dir}", "reward_model.rule_reward_coef=1.0",
        "reward_model.micro_batch_size_per_gpu=2",
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        record = records[step]
        for key in ("timing_s/gen", "timing_s/gen_max", "timing_s/rm", "timing_s/reward", "reward/rm_score/mean",
                    "reward/rule_score/mean", "train/num_gen_batches", "filter_groups/kept_fraction"):
            assert key in record, key
        assert record["filter_groups/kept_groups"] >= 2 and 1 <= record["train/num_gen_batches"] <= 4
        assert record["actor/grad_norm"] > 0
        assert record["critic/score/mean"] != record["reward/rule_score/mean"], "the reward model's score counts"


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_rollout_correction_weights_and_rejection_in_a_grpo_step(workspace):
    """Token TIS and a token rejection rule on the driver: verl's `rollout_corr/*` metrics are logged, and with
    the trainer's and the hf rollout's log-probs agreeing the weights are about 1 and nothing is rejected."""
    records = by_step(run(overrides(
        workspace, workspace / "rollout_correction", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
        "trainer.val_before_train=False", "data.val_files=[]",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    )))
    step = records[1]
    assert "timing_s/old_log_prob" in step, "correction needs the separate old-log-prob pass"
    assert abs(step["rollout_corr/rollout_is_mean"] - 1.0) < 1e-2
    assert abs(step["rollout_corr/rollout_is_eff_sample_size"] - 1.0) < 1e-2
    assert step["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert step["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert abs(step["rollout_corr/kl"]) < 1e-2 and step["rollout_corr/training_ppl"] > 1.0
    assert step["actor/grad_norm"] > 0


@pytest.mark.slow  # the engine's bf16 weights are tested in every CI run (test_bf16_weights)
@pytest.mark.parametrize("rollout", ["hf", "native"])
def test_grpo_with_bf16_weights_hands_them_to_the_rollout(workspace, rollout):
    """verl's fsdp_config.model_dtype=bfloat16 for the actor and the reference: both train/score in bf16, and the
    rollout's log-probs still match the trainer's (the weights it generates with are the trained ones)."""
    records = by_step(run(overrides(
        workspace, workspace / f"bf16_{rollout}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.rollout.name={rollout}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
        "+actor_rollout_ref.ref.fsdp_config.model_dtype=bfloat16", "actor_rollout_ref.actor.ppo_epochs=2",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        record = records[step]
        assert record["actor/grad_norm"] > 0 and "actor/kl_loss" in record
        # bf16 trainer against the rollout's own log-probs of the same weights
        assert abs(record["training/rollout_probs_diff_mean"]) < 0.05, record["training/rollout_probs_diff_mean"]


@pytest.mark.slow  # the parts' save and load are tested in every CI run (test_fsdp_engine, test_config_tree)
def test_export_only_checkpoints_hold_a_loadable_model_and_are_not_resumed(workspace):
    """verl's save_contents=['hf_model']: each checkpoint is a full HF directory of the actor, no shards; a run
    that would resume from it is refused before Ray, naming the export."""
    import torch

    from hybridflow.models import build_causal_lm
    from hybridflow.trainer.config.loader import load_config
    from hybridflow.trainer.config.validate import validate_config

    run_dir = workspace / "export_only"
    args = overrides(
        workspace, run_dir, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1", "trainer.save_freq=1",
        "trainer.val_before_train=False", "data.val_files=[]",
        "actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]",
    )
    run(args)
    actor = run_dir / "global_step_1" / "actor"
    assert not list(actor.glob("*_world_size_*")), "no shards: exports only"
    model = build_causal_lm(actor / "huggingface_full")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
    with pytest.raises(ValueError, match=r"holds no training state .* its exported model is .*huggingface_full"):
        validate_config(load_config(args))


@pytest.mark.slow  # a long end-to-end run; the estimator and the engine's sum(pi^2) are tested in every CI run
def test_optimal_token_baseline_with_importance_weights_trains(workspace):
    """verl's OTB example's keys: the old-log-prob pass returns sum(pi^2), the estimator reads it with the
    rollout's importance weights, and verl's variance_proxy/* metrics are logged."""
    records = by_step(run(overrides(
        workspace, workspace / "otb", "algorithm.adv_estimator=optimal_token_baseline",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
        "trainer.val_before_train=False", "data.val_files=[]", "algorithm.rollout_correction.rollout_is=token",
    )))
    for step in (1, 2):
        record = records[step]
        assert "timing_s/old_log_prob" in record and record["actor/grad_norm"] > 0
        assert record["variance_proxy/proxy2_total_power"] >= 0 and record["variance_proxy/expected_w"] > 0
        assert record["variance_proxy/proxy1_signal_strength"] == pytest.approx(record["actor/grad_norm"] ** 2)


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_bypass_mode_reinforce_with_weights_and_rejection_in_a_grpo_step(workspace):
    """verl's bypass_pg_is-style preset: no old-log-prob pass; inside the loss the current policy against the native
    rollout's log-probs gives weights about 1, rejects nothing, and the REINFORCE loss trains."""
    records = by_step(run(overrides(
        workspace, workspace / "bypass_reinforce", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=native", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
        "algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    )))
    for step in (1, 2):
        record = records[step]
        assert "timing_s/old_log_prob" not in record, "bypass mode takes the rollout's log-probs"
        assert abs(record["rollout_corr/rollout_is_mean"] - 1.0) < 0.2, record["rollout_corr/rollout_is_mean"]
        assert record["rollout_corr/rollout_rs_masked_fraction"] < 0.5
        assert record["actor/grad_norm"] > 0


@pytest.mark.slow  # tests/workers/test_distillation_teacher.py checks the teacher's log-probs in every CI run
def test_on_policy_distillation_toward_a_teacher(workspace):
    """A reference other than the actor's model is a teacher: from the first step the KL loss is the student's
    reverse KL to it (to itself, the first step's KL would be 0)."""
    teacher_dir = workspace / "tiny_teacher"
    if not teacher_dir.exists():
        save_tiny_model_like(teacher_dir)
    records = by_step(run(overrides(
        workspace, workspace / "distill", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"actor_rollout_ref.ref.model.path={teacher_dir}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.kl_loss_coef=1.0", "trainer.total_training_steps=2",
        "trainer.val_before_train=False", "data.val_files=[]",
    )))
    assert records[1]["actor/kl_loss"] > 0.01, "the student starts away from the teacher"
    assert records[2]["actor/grad_norm"] > 0


def save_tiny_model_like(path: Path) -> None:
    from hybridflow.models import save_tiny_model

    save_tiny_model(path, num_layers=2, hidden=64, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_grpo_with_the_experts_split_over_the_native_rollouts_tensor_parallel_group(workspace, arch):
    """Two GRPO steps of a tiny Qwen2-MoE or DeepSeek-V3 (latent attention split by heads) on 2 ranks whose native
    rollout decodes one replica with tensor_model_parallel_size=2 and expert_parallel_size=2 (each rank holds 2 of
    the 4 experts): the hand-over reaches each rank's experts, and the rollout's log-probs match the trainer's."""
    from hybridflow.models.moe import save_tiny_moe_model

    model_dir = save_tiny_moe_model(workspace / f"tiny_{arch}", arch)
    records = by_step(run(overrides(
        workspace, workspace / f"rollout_ep_{arch}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=native", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.expert_parallel_size=2",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        assert records[step]["actor/grad_norm"] > 0
        assert records[step]["training/rollout_probs_diff_max"] < 1e-3, (step, records[step]["training/rollout_probs_diff_max"])
    assert records[2]["rollout/weight_version"] > records[1]["rollout/weight_version"]


@pytest.mark.slow
def test_grpo_with_expert_parallelism_and_ulysses(workspace):
    """Two GRPO steps of a tiny Qwen3-MoE on 2 ranks with expert_parallel_size=2 and ulysses_sequence_parallel_size=2
    (each rank holds half of the experts and half of every packed row): the update runs, and the rollout's log-probs
    match the trainer's after the hand-over of every expert."""
    from hybridflow.models.moe import save_tiny_moe_model

    model_dir = save_tiny_moe_model(workspace / "tiny_qwen3_moe", "qwen3_moe")
    records = by_step(run(overrides(
        workspace, workspace / "ep_sp", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        assert records[step]["actor/grad_norm"] > 0 and records[step]["actor/moe/router_entropy"] > 0
        assert records[step]["training/rollout_probs_diff_max"] < 1e-3, (step, records[step]["training/rollout_probs_diff_max"])


# Slow tier (the default suite's time budget): expert-parallel training equals one process in
# tests/engines/training/test_expert_parallel.py, and the default suite's LoRA-on-experts run below hands a tiny
# Mixtral's experts from 2 FSDP ranks to the native rollout.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_grpo_on_a_moe_with_the_native_rollout_hands_the_experts_over(workspace, arch):
    """Two GRPO steps of a tiny MoE on 2 FSDP ranks with expert parallelism (each rank trains 2 of the 4
    experts): the native rollout runs the model's own routing (DeepSeek-V3: and its latent attention), and after
    the first update it receives every expert's new weights, gathered from both ranks (its log-probs still match
    the trainer's)."""
    from hybridflow.models.moe import save_tiny_moe_model

    model_dir = save_tiny_moe_model(workspace / f"tiny_{arch}", arch)
    records = by_step(run(overrides(
        workspace, workspace / arch, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=native", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2", "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        record = records[step]
        assert record["actor/grad_norm"] > 0 and record["actor/moe/router_entropy"] > 0
        assert record["training/rollout_probs_diff_max"] < 1e-3, (step, record["training/rollout_probs_diff_max"])
    assert records[2]["rollout/weight_version"] > records[1]["rollout/weight_version"]
    # the native engine's own figures reach the step's metrics (CUDA graphs: none on CPU)
    assert records[2]["rollout/engine/num_decode_steps"] > 0 and records[2]["rollout/engine/decode_s"] > 0
    assert records[2]["rollout/engine/decode_graph_captures"] == 0 and records[2]["timing_s/rollout_wake_up"] >= 0


@pytest.mark.slow  # the suite's budget on the slower host; test_moe_families covers both families' engines by default
@pytest.mark.parametrize("model_type", ["gpt_oss", "minimax"])
def test_grpo_with_router_replay_on_another_moe_family(workspace, model_type):
    """Two GRPO steps with router replay (R3) on a family the project ships no builder for, run padded:
    gpt-oss (eager attention: it has no sdpa path, and the rollout's copy must take the trainer's kernel) or
    MiniMax (linear-attention layers). The rollout records its experts, the trainer replays them, and the log-probs
    of both agree."""
    from hybridflow.models.loader import load_tokenizer
    from tests.model_families import save_family_model

    attn = "eager" if model_type == "gpt_oss" else "sdpa"
    model_dir = save_family_model(workspace / model_type, model_type, load_tokenizer(str(workspace / "tiny")), attn)
    records = by_step(run(overrides(
        workspace, workspace / f"r3_{model_type}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={attn}",
        "actor_rollout_ref.model.use_remove_padding=False", "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "trainer.total_training_steps=2",
        "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        assert records[step]["actor/grad_norm"] > 0 and records[step]["actor/moe/router_entropy"] > 0
        assert records[step]["training/rollout_probs_diff_max"] < 1e-3, (step, records[step]["training/rollout_probs_diff_max"])


LORA_ON_EXPERTS = ["actor_rollout_ref.model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"]
LORA_WITH_EP = ["actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2"]


@pytest.mark.parametrize("extra", [LORA_ON_EXPERTS, pytest.param(LORA_WITH_EP, marks=pytest.mark.slow)],
                         ids=["on_experts", "attention_with_ep"])
def test_grpo_with_lora_on_a_moe_hands_merged_weights_to_the_rollout(workspace, extra):
    """Two GRPO steps of a tiny Mixtral on 2 FSDP ranks with LoRA on attention and on every expert
    (`target_parameters`), or on attention with the experts split over the ranks (EP=2): the native rollout
    receives the merged weights after the first update, and its log-probs still match the trainer's."""
    from hybridflow.models.moe import save_tiny_moe_model

    model_dir = save_tiny_moe_model(workspace / "tiny_mixtral", "mixtral")
    records = by_step(run(overrides(
        workspace, workspace / "lora_moe", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=native", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]", *extra,
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
    )))
    for step in (1, 2):
        assert records[step]["actor/grad_norm"] > 0
        assert records[step]["training/rollout_probs_diff_max"] < 1e-3, (step, records[step]["training/rollout_probs_diff_max"])
    assert records[2]["rollout/weight_version"] > records[1]["rollout/weight_version"]
