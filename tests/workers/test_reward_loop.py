"""verl's reward loop (`reward_model.use_reward_loop=True`) with a discriminative reward model: the keys land where
they act (`reward_model.rollout.*` on the reward model's engine, `num_workers` on the scorer processes), and the
worker scores every conversation re-templated in the reward model's chat template, cut to max_model_len, in
micro-batches of max_num_batched_tokens, as the HF classifier scores it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.models import load_tokenizer, save_tiny_model, save_tiny_reward_model
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.workers import RewardModelWorker
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.reward_config import RewardModelModelConfig, RewardModelWorkerConfig, RewardServingConfig
from hybridflow.workers.reward_model import check_serving_memory, encode_chat
from tests.workers.test_reward_model_worker import ANSWERS, MESSAGES, hf_scores, policy_batch

LOOP = ["reward_model.enable=True", "reward_model.use_reward_loop=True"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_loop")
    return {"policy": str(save_tiny_model(root / "policy", seed=0)), "rm": str(save_tiny_reward_model(root / "rm", seed=3))}


def loop_group(models, **serving) -> LocalWorkerGroup:
    model = RewardModelModelConfig(path=models["rm"], input_tokenizer=models["policy"])
    rollout = RewardServingConfig(**{"tensor_model_parallel_size": 1, "dtype": "float32", **serving})
    config = RewardModelWorkerConfig(enable=True, use_reward_loop=True, model=model, rollout=rollout)
    group = LocalWorkerGroup(RayClassWithInitArgs(RewardModelWorker, config, WorkerRuntimeConfig(seed=0, num_threads=1)))
    group.init_model()
    return group


@pytest.fixture(scope="module")
def scored(models) -> tuple:
    """The policy's batch and its scores from the loop's default worker (float32)."""
    batch = policy_batch(load_tokenizer(models["policy"]))
    return batch, loop_group(models).compute_rm_score(batch).batch["rm_scores"]


def conversations(models) -> list[list[int]]:
    """Each row's whole conversation (prompt and answer) in the reward model's chat template."""
    tokenizer = load_tokenizer(models["rm"])
    return [encode_chat(tokenizer, [*m, {"role": "assistant", "content": a}]) for m, a in zip(MESSAGES, ANSWERS)]


def test_the_loop_re_templates_even_for_the_policy_s_own_tokenizer(models, scored):
    """The reward model shares the policy's tokenizer, which the legacy worker feeds ids as they are; the loop
    decodes and re-templates like verl's (the policy's prompt template and the response's eos are not scored)."""
    batch, scores = scored
    expected = hf_scores(models["rm"], conversations(models))
    last = batch.batch["response_mask"].sum(-1) - 1
    assert scores[torch.arange(2), last].tolist() == pytest.approx(expected, abs=1e-5)
    assert scores.sum(-1).tolist() == pytest.approx(expected, abs=1e-5)


def test_token_budget_and_max_model_len_cut_as_the_keys_say(models, scored):
    batch, whole = scored
    shortest = min(len(ids) for ids in conversations(models))  # the longer row is over the budget: scored alone
    small = loop_group(models, max_num_batched_tokens=shortest)
    assert torch.allclose(small.compute_rm_score(batch).batch["rm_scores"], whole, atol=1e-5), "one row at a time"
    cut = loop_group(models, max_model_len=6).compute_rm_score(batch).batch["rm_scores"].sum(-1)
    expected = hf_scores(models["rm"], [ids[-6:] for ids in conversations(models)])
    assert cut.tolist() == pytest.approx(expected, abs=1e-5), "a conversation over max_model_len keeps its end"


def test_the_bfloat16_forward_stays_near_the_float32_one(models, scored):
    batch, full = scored[0], scored[1].sum(-1)
    half = loop_group(models, dtype="bfloat16").compute_rm_score(batch).batch["rm_scores"].sum(-1)
    assert half.dtype == torch.float32 and not torch.equal(half, full), "the forward ran in bfloat16"
    assert torch.allclose(half, full, atol=0.05, rtol=0.05)


def test_weights_over_the_memory_share_name_the_key(models):
    module = torch.nn.Linear(1024, 1024)
    check_serving_memory(module, torch.device("cpu"), 0.5)
    with pytest.raises(ValueError, match=r"reward_model.rollout.gpu_memory_utilization=1e-09 .*less than its weights"):
        check_serving_memory(module, torch.device("cpu"), 1e-9)


# ----------------------------------------------------------------------------- config
def test_the_loop_s_keys_land_on_the_reward_model_s_engine_and_the_scorers():
    cfg = load_config([*LOOP, "reward_model.rollout.name=hf", "reward_model.rollout.tensor_model_parallel_size=4",
                       "reward_model.rollout.max_num_batched_tokens=512", "reward_model.rollout.prompt_length=100",
                       "reward_model.rollout.response_length=28", "reward_model.num_workers=3"])
    reward = cfg.reward_model
    engine = reward.engine_config()
    assert (engine.fsdp.tensor_parallel_size, engine.fsdp.dtype) == (4, "bfloat16")
    assert (reward.forward_token_budget, reward.max_input_tokens, reward.scoring.num_workers) == (512, 128, 3)
    legacy = load_config(["reward_model.enable=True", "reward_model.max_length=64"]).reward_model
    assert (legacy.engine_config().fsdp.dtype, legacy.forward_token_budget, legacy.max_input_tokens) == ("auto", None, 64)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["reward_model.rollout.name=vllm"], r"reward_model.rollout.name='vllm': .*set reward_model.rollout.name=hf"),
        (["reward_model.rollout.enforce_eager=False"], r"reward_model.rollout.enforce_eager=False .*runs eager"),
        (["reward_model.rollout.max_num_seqs=8"], r"reward_model.rollout.max_num_seqs=8 .*max_num_batched_tokens"),
        (["reward_model.max_length=64"], r"reward_model.max_length=64 sets the legacy .*reward_model.rollout.max_model_len"),
        (["reward_model.model.fsdp_config.tensor_parallel_size=2"],
         r"reward_model.model.fsdp_config.tensor_parallel_size=2 .*reward_model.rollout.tensor_model_parallel_size"),
        (["reward_model.rollout.gpu_memory_utilization=1.5"], r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    ],
)
def test_loop_settings_that_would_not_act_are_refused(extra, words):
    with pytest.raises(ValueError, match=words):
        load_config([*LOOP, *extra])


def test_loop_keys_without_the_loop_are_refused():
    with pytest.raises(ValueError, match=r"reward_model.rollout.\* serves .*got reward_model.enable=True, "
                                         r"reward_model.use_reward_loop=False"):
        load_config(["reward_model.enable=True", "reward_model.rollout.tensor_model_parallel_size=1"])


def test_the_loop_s_layout_and_its_generative_form_s_function_are_checked_before_ray(tmp_path, models):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]], "data_source": ["x"],
                             "reward_model": [{"ground_truth": "1"}]}), data)
    line = [f"data.train_files={data}", f"actor_rollout_ref.model.path={models['policy']}", *LOOP,
            f"reward_model.model.path={models['rm']}", "data.train_batch_size=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    with pytest.raises(ValueError, match=r"reward_model.rollout.tensor_model_parallel_size=2, .* over 1 ranks"):
        validate_config(load_config(line))  # verl's default of 2 ranks per replica, on a 1-rank pool
    ok = [*line, "reward_model.rollout.tensor_model_parallel_size=1"]
    validate_config(load_config(ok))
    with pytest.raises(ValueError, match=r"rollout.name='native' generates; a discriminative reward model"):
        validate_config(load_config([*ok, "reward_model.rollout.name=native"]))
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    # with a custom function the reward model is a generative judge (tests/workers/test_generative_reward.py)
    with pytest.raises(ValueError, match=r"generative reward model .* is a \.\.\.ForCausalLM checkpoint"):
        validate_config(load_config([*ok, f"custom_reward_function.path={reward_file}"]))


def test_the_serving_defaults_are_verl_s():
    """verl's dp_reward_loop.yaml `rollout:` values, so that a verl line means the same here."""
    verl = {"dtype": "bfloat16", "gpu_memory_utilization": 0.5, "tensor_model_parallel_size": 2,
            "expert_parallel_size": 1, "data_parallel_size": 1, "max_num_batched_tokens": 8192, "max_model_len": None,
            "max_num_seqs": 1024, "prompt_length": 2048, "response_length": 2048, "free_cache_engine": True,
            "enforce_eager": True, "enable_chunked_prefill": True, "enable_prefix_caching": True,
            "skip_tokenizer_init": False, "load_format": "auto"}
    serving = dataclasses.asdict(RewardServingConfig())
    assert {key: serving[key] for key in verl} == verl


def test_micro_batching_follows_the_token_budget_and_the_legacy_row_count(models):
    """The loop's micro-batches: about max_num_batched_tokens each, stretched for a longer conversation, and at
    least one per reward_model.micro_batch_size_per_gpu rows (verl's reward-loop scripts keep that key)."""
    worker = RewardModelWorker(RewardModelWorkerConfig(
        enable=True, use_reward_loop=True, micro_batch_size_per_gpu=2,
        model=RewardModelModelConfig(path=models["rm"]), rollout=RewardServingConfig(max_num_batched_tokens=64),
    ), WorkerRuntimeConfig())
    mask = torch.zeros(5, 100, dtype=torch.long)
    mask[:, :10] = 1
    mask[0] = 1
    assert worker._micro_batching(mask) == {"max_token_len": 100, "min_micro_batches": 3}
    legacy = RewardModelWorker(RewardModelWorkerConfig(enable=True, model=RewardModelModelConfig(path=models["rm"])),
                               WorkerRuntimeConfig())
    assert legacy._micro_batching(mask) == {"micro_batch_size": 5, "max_token_len": None}
