"""LoRA: merging adapters (vs peft), LoRA training engines (only adapters move, reference = adapter disabled,
merged weight hand-over), and the adapter directory a checkpoint writes."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hybridflow.engines.training import FSDPEngine, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models import build_causal_lm, build_tiny_model, load_tokenizer, save_tiny_model
from hybridflow.models.config import ModelConfig
from hybridflow.models.lora import (
    LoraScaling,
    merge_lora_named_tensors,
    merge_lora_state_dict,
    to_hf_name,
)
from tests.engines.helpers import make_batch, seq_mean_nll

LORA = FSDPEngineConfig(
    model=ModelConfig(lora_rank=8, lora_alpha=16), micro_batch_size_per_gpu=4, optim=OptimConfig(lr=1e-2)
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, local_tokenizer):
    return str(save_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", tokenizer=local_tokenizer))


@pytest.fixture(scope="module")
def batch(model_dir):
    return make_batch(len(load_tokenizer(model_dir)), batch_size=4, seed=3)


def randomized_lora_model(local_tokenizer, **lora_config):
    """A tiny peft model whose adapters are non-zero (fresh lora_B is all zeros)."""
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_model(tokenizer=local_tokenizer)
    config = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **lora_config}
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **config))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def test_to_hf_name_strips_the_peft_wrapping():
    peft_name = "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"
    assert to_hf_name(peft_name) == "model.layers.0.mlp.up_proj.weight"
    assert to_hf_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert to_hf_name("model.norm.weight") == "model.norm.weight"


def test_merged_state_dict_equals_peft_merge_and_unload(local_tokenizer):
    model = randomized_lora_model(local_tokenizer)
    scaling = LoraScaling(lora_alpha=8)
    merged = merge_lora_state_dict(model.state_dict(), scaling)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-7, msg=name)
    # The streaming merge (weight hand-over) gives the same tensors from the parameter stream.
    streamed = dict(merge_lora_named_tensors(model.named_parameters(), scaling))
    assert set(streamed) <= set(merged) and "model.layers.0.self_attn.q_proj.weight" in streamed
    for name, tensor in streamed.items():
        assert torch.equal(tensor, merged[name]), name


def test_rslora_scaling_matches_peft(local_tokenizer):
    model = randomized_lora_model(local_tokenizer, use_rslora=True, target_modules=["q_proj", "v_proj"])
    merged = merge_lora_state_dict(model.state_dict(), LoraScaling(lora_alpha=8, use_rslora=True))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        torch.testing.assert_close(merged[name], expected[name], rtol=0, atol=1e-7, msg=name)


def test_incomplete_lora_modules_are_an_error():
    with pytest.raises(ValueError, match="incomplete LoRA modules"):
        list(merge_lora_named_tensors([("a.q.base_layer.weight", torch.zeros(2, 2))], LoraScaling(lora_alpha=1)))
    with pytest.raises(ValueError, match="unsupported adapter_config"):
        LoraScaling.from_adapter_config({"lora_alpha": 16, "use_dora": True})


def test_lora_step_trains_only_the_adapters_and_the_reference_is_the_base(model_dir, batch):
    engine = build_fsdp_engine(model_dir, LORA)
    before = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    trainable = {name for name, param in engine.module.named_parameters() if param.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    metrics = engine.train_batch(batch, seq_mean_nll)
    assert metrics["grad_norm"] > 0
    changed = {name for name, param in engine.module.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= trainable, "base weights must stay frozen"
    assert any(".lora_B." in name for name in changed)

    base = FSDPEngine(build_causal_lm(model_dir), FSDPEngineConfig())
    base_log_probs, _ = base.compute_log_prob(batch)
    ref_log_probs, _ = engine.compute_log_prob(batch, disable_adapter=True)
    policy_log_probs, _ = engine.compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(ref_log_probs[mask], base_log_probs[mask], rtol=0, atol=1e-5)
    assert (policy_log_probs - base_log_probs)[mask].abs().max() > 1e-3, "the adapter changed the policy"

    # Hand-over: the merged plain weights reproduce the LoRA policy in a plain HF model.
    plain = build_causal_lm(model_dir)
    missing, unexpected = plain.load_state_dict(dict(engine.named_full_params()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    merged_log_probs, _ = FSDPEngine(plain, FSDPEngineConfig()).compute_log_prob(batch)
    torch.testing.assert_close(merged_log_probs[mask], policy_log_probs[mask], rtol=0, atol=1e-5)
    assert engine.lora_scaling == LoraScaling(lora_alpha=16)


def test_checkpoint_writes_a_peft_adapter_that_training_can_continue_from(model_dir, batch, tmp_path, monkeypatch):
    engine = build_fsdp_engine(model_dir, LORA)
    engine.train_batch(batch, seq_mean_nll)
    engine.save_checkpoint(tmp_path / "ckpt")
    adapter_dir = tmp_path / "ckpt" / "lora_adapter"
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()
    monkeypatch.setenv("HOME", str(tmp_path / "ckpt"))  # `~` is expanded by the config check and the loader alike
    resumed_config = FSDPEngineConfig(model=ModelConfig(lora_rank=8, lora_adapter_path="~/lora_adapter"))
    resumed = build_fsdp_engine(model_dir, resumed_config)
    assert resumed.lora_scaling == engine.lora_scaling
    trained = dict(engine.module.named_parameters())
    for name, param in resumed.module.named_parameters():
        assert torch.equal(param, trained[name]), name
        assert param.requires_grad == trained[name].requires_grad, name
    # As in verl, the path alone turns LoRA on with the adapter's rank and alpha; another rank beside it is refused.
    alone = build_fsdp_engine(model_dir, FSDPEngineConfig(model=ModelConfig(lora_adapter_path="~/lora_adapter")))
    assert alone.lora_scaling == engine.lora_scaling
    assert all(torch.equal(param, trained[name]) for name, param in alone.module.named_parameters())
    with pytest.raises(ValueError, match=r"^lora_rank=4 differs from the adapter's 8 at lora_adapter_path="):
        ModelConfig(lora_rank=4, lora_adapter_path="~/lora_adapter")
    # So do other alpha or targets: the adapter's own config rules them, and they were ignored.
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    ModelConfig(lora_alpha=saved["lora_alpha"], target_modules=sorted(saved["target_modules"]),
                lora_adapter_path="~/lora_adapter")
    for key, other in (("lora_alpha", saved["lora_alpha"] * 2), ("target_modules", ["q_proj"]),
                       ("target_modules", "q_proj"), ("exclude_modules", ["o_proj"])):
        with pytest.raises(ValueError, match=rf"^{key}=.* differs from the adapter's .* at lora_adapter_path=.*"
                                             rf"leave {key} unset or set it to the adapter's"):
            ModelConfig(lora_adapter_path="~/lora_adapter", **{key: other})
    engine.save_hf_model(tmp_path / "hf")
    exported = build_causal_lm(tmp_path / "hf").state_dict()
    for name, tensor in engine.named_full_params():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("target_modules", [["q_proj", "v_proj"], "q_proj, v_proj"])
def test_target_modules_pick_the_adapted_layers(model_dir, target_modules):
    model = ModelConfig(lora_rank=4, target_modules=target_modules)
    assert model.use_lora and model.lora_target_modules == ("q_proj", "v_proj")
    engine = build_fsdp_engine(model_dir, FSDPEngineConfig(model=model))
    adapted = {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in engine.module.named_parameters()
               if ".lora_A." in name}
    assert adapted == {"q_proj", "v_proj"}
    assert ModelConfig(lora_rank=4).lora_target_modules == "all-linear"


@pytest.mark.parametrize("exclude", [["o_proj", "down_proj"], "o_proj,down_proj", r".*\.(o_proj|down_proj)"])
def test_exclude_modules_keep_matched_layers_without_adapters(model_dir, exclude):
    """verl's model.exclude_modules: all-linear minus the excluded layers (names, or a regex on full names)."""
    model = ModelConfig(lora_rank=4, exclude_modules=exclude)
    engine = build_fsdp_engine(model_dir, FSDPEngineConfig(model=model))
    adapted = {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in engine.module.named_parameters()
               if ".lora_A." in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not ModelConfig(exclude_modules="DONT_EXCLUDE").use_lora  # verl's scripts set it with LoRA off


def test_lora_misuse_is_refused(model_dir, batch):
    with pytest.raises(ValueError, match="causal LMs only"):
        build_fsdp_engine(model_dir, LORA, model_kind="value")
    with pytest.raises(ValueError, match="needs a LoRA engine"):
        FSDPEngine(build_causal_lm(model_dir), FSDPEngineConfig()).compute_log_prob(batch, disable_adapter=True)
    with pytest.raises(ValueError, match="^lora_adapter_path=.* is not a peft adapter directory"):
        ModelConfig(lora_rank=8, lora_adapter_path=model_dir)
    with pytest.raises(ValueError, match="^lora_adapter_path=.* is not a peft adapter directory"):
        ModelConfig(lora_adapter_path=model_dir)  # the path alone turns LoRA on, and is checked


# ----------------------------------------------------------------------------- LoRA RL
def lora_worker_args(model_dir: str, rollout_name: str = "hf") -> tuple:
    from hybridflow.engines.rollout.config import RolloutConfig
    from hybridflow.workers import ActorRolloutRefWorker
    from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig, WorkerRuntimeConfig

    config = ActorRolloutRefConfig(
        model=ModelConfig(path=model_dir, lora_rank=8, lora_alpha=16),
        actor=ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=5e-2)),
        rollout=RolloutConfig(name=rollout_name, temperature=1.0, prompt_length=6, response_length=5),
    )
    runtime = WorkerRuntimeConfig(seed=0, num_threads=1)
    return ActorRolloutRefWorker, config, "actor_rollout_ref", runtime


def check_lora_rl_steps(group, model_dir: str, handed_over: bool) -> None:
    """Two generate -> log-prob -> ref -> update rounds, checking the rollout and the reference each time."""
    from hybridflow.protocol import DataProto

    ids = torch.randint(5, 400, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})
    base = FSDPEngine(build_causal_lm(model_dir), FSDPEngineConfig())
    for step in range(2):
        batch = group.generate_sequences(prompts)
        update_s = min(batch.meta_info["metrics"]["timing_s/update_weights"])
        assert (update_s > 0) if handed_over else (update_s == 0), update_s
        batch.meta_info = {"temperature": 1.0}
        response_mask = batch.batch["response_mask"].bool()
        old = group.compute_log_prob(batch)
        # The rollout generated with the policy (merged weights, or adapters active): same log-probs.
        diff = (old.batch["old_log_probs"] - batch.batch["rollout_log_probs"])[response_mask].abs().max()
        assert diff < 1e-4, (step, float(diff))
        ref = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
        base_log_probs, _ = base.compute_log_prob(batch)
        assert (ref - base_log_probs)[response_mask].abs().max() < 1e-5, step
        policy_vs_base = (old.batch["old_log_probs"] - base_log_probs)[response_mask].abs().max()
        assert (policy_vs_base < 1e-5) if step == 0 else (policy_vs_base > 1e-3), (step, float(policy_vs_base))
        assert min(old.meta_info["metrics"]["actor/entropy"]) > 0, "entropy comes back as a metric"
        old.meta_info = {}
        batch = batch.union(old)
        batch.batch["ref_log_prob"] = ref
        batch.batch["advantages"] = torch.linspace(-1, 1, 4)[:, None].expand(-1, 5).contiguous()
        group.update_actor(batch)


def test_lora_rl_worker_in_process_generates_with_the_adapter(model_dir):
    """One rank: the rollout shares the actor's module (adapters active), no hand-over, no second model."""
    from hybridflow.single_controller.local import LocalWorkerGroup
    from hybridflow.single_controller.ray import RayClassWithInitArgs

    cls, *args = lora_worker_args(model_dir)
    group = LocalWorkerGroup(RayClassWithInitArgs(cls, *args), world_size=1)
    group.init_model()
    worker = group.workers[0]
    assert worker.ref_engine is None, "the LoRA reference is the actor with its adapter disabled"
    check_lora_rl_steps(group, model_dir, handed_over=False)


def test_lora_rl_worker_in_process_with_native_rollout_hands_over_merged_weights(model_dir):
    """One rank, a backend that reads plain weights: it gets its own copy and the merged weights each step."""
    from hybridflow.single_controller.local import LocalWorkerGroup
    from hybridflow.single_controller.ray import RayClassWithInitArgs

    cls, *args = lora_worker_args(model_dir, rollout_name="native")
    group = LocalWorkerGroup(RayClassWithInitArgs(cls, *args), world_size=1)
    group.init_model()
    assert group.workers[0].rollout.model is not group.workers[0].actor_engine.module
    check_lora_rl_steps(group, model_dir, handed_over=True)


# The same steps run in one process in every CI run (test_lora_rl_worker_in_process_with_native_rollout_hands_over_...),
# and LoRA on two Ray ranks in test_lora_grpo_end_to_end_and_export.
@pytest.mark.slow
def test_lora_rl_worker_on_two_ranks_hands_over_merged_weights(ray_cluster, model_dir):
    """Reference = the actor with its adapter disabled (equals the base model); the rollout receives merged weights."""
    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    cls, *args = lora_worker_args(model_dir)
    pool = RayResourcePool([2])
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls, *args))
    try:
        group.init_model()
        check_lora_rl_steps(group, model_dir, handed_over=True)
    finally:
        group.shutdown()
        pool.release()


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_lora_grpo_end_to_end_and_export(ray_cluster, tmp_path):
    """GRPO through `run_ppo` with actor_rollout_ref.model.lora_rank=8 on 2 Ray workers, then `hybridflow merge`."""
    from hybridflow.trainer.config import load_config, validate_config
    from hybridflow.engines.training.merge import merge_checkpoint
    from hybridflow.trainer.run import run_ppo
    from tests.tiny_runs import build_workspace
    from tests.trainer.e2e_runs import GRPO, by_step, overrides

    build_workspace(tmp_path, train_size=8, test_size=4)
    run_dir = tmp_path / "run"
    lora = ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=2", "trainer.val_before_train=False")
    replaced = {item.split("=")[0] for item in lora}
    args = [item for item in overrides(tmp_path, run_dir, *GRPO) if item.split("=")[0] not in replaced] + list(lora)
    config = load_config(args)
    run_ppo(config, validate_config(config))
    import json

    records = by_step([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    assert sorted(records) == [1, 2]
    # One mini-batch per step: step 1 updates from the fresh adapter (lora_B = 0), which is the reference policy.
    assert records[1]["actor/kl_loss"] < 1e-6
    assert records[2]["actor/kl_loss"] > 0 and records[2]["actor/grad_norm"] > 0
    assert (run_dir / "global_step_2" / "actor" / "lora_adapter" / "adapter_config.json").is_file()
    target = merge_checkpoint(run_dir / "global_step_2", tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(target)


def test_lora_on_a_moe_model_trains_attention_and_refuses_experts(tmp_path):
    """A Qwen3-MoE with LoRA on its attention trains and hands over merged plain weights; 'all-linear' (peft 0.21 then
    wraps the 3-D expert weights and the routers) and targets naming expert weights are refused with the fix."""
    from hybridflow.models.lora import apply_lora
    from hybridflow.models.moe import build_tiny_moe_model, save_tiny_moe_model

    path = save_tiny_moe_model(tmp_path / "moe", "qwen3_moe")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = FSDPEngineConfig(
        micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2),
        model=ModelConfig(lora_rank=4, lora_alpha=8, target_modules=attention),
    )
    engine = build_fsdp_engine(path, config)
    trainable = [name for name, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".self_attn." in name and ".lora_" in name for name in trainable)
    batch = make_batch(len(load_tokenizer(path)), batch_size=4)
    losses = [engine.train_batch(batch, seq_mean_nll)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    merged = dict(engine.named_full_params())
    plain = build_causal_lm(path).state_dict()
    assert merged.keys() == dict(build_causal_lm(path).named_parameters()).keys()
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], plain["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(merged["model.layers.0.mlp.experts.gate_up_proj"], plain["model.layers.0.mlp.experts.gate_up_proj"])

    with pytest.raises(ValueError, match=r"adapters on this mixture-of-experts model's expert weights.*q_proj,k_proj"):
        apply_lora(build_tiny_moe_model("qwen3_moe")[0], lora_rank=4, lora_alpha=8, target_modules="all-linear")
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\] are this mixture-of-experts model's expert weights"):
        apply_lora(build_tiny_moe_model("qwen3_moe")[0], lora_rank=4, lora_alpha=8,
                   target_modules=["q_proj", "gate_up_proj"])
