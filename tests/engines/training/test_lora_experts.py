"""LoRA on a mixture-of-experts model's experts (`target_parameters`): the adapters train, their merge (the
rollout's hand-over and the exported model) equals peft's own `merge_and_unload`, FSDP2 over 2 ranks equals one
process, and the settings it cannot serve are refused naming the key."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.config import FSDPConfig
from hybridflow.models import load_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.models.moe import save_tiny_moe_model
from hybridflow.trainer.config import load_config, validate_config
from tests.engines.helpers import make_batch, run_distributed, seq_mean_nll
from tests.helpers import grpo_overrides, nothing_started, write_rows
from tests.model_families import save_family_model

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _config(attention: list[str], **fsdp) -> FSDPEngineConfig:
    return FSDPEngineConfig(micro_batch_size_per_gpu=2, optim=OptimConfig(lr=5e-2), model=ModelConfig(
        lora_rank=4, lora_alpha=8, target_modules=attention, target_parameters=EXPERTS,
        override_config=fsdp.pop("override_config", {}),
    ), **fsdp)


@pytest.mark.parametrize(("arch", "attention"), [
    ("mixtral", ["q_proj", "v_proj"]), ("deepseek_v3", ["q_b_proj"]), ("gpt_oss", ["q_proj"]),
])
def test_expert_adapters_train_and_merge_as_peft_does(tmp_path, tiny_tokenizer, arch, attention):
    """gpt-oss stores its experts transposed (experts, in, out) and has expert biases: the merge follows it."""
    if arch == "gpt_oss":
        path = save_family_model(tmp_path / arch, arch, tiny_tokenizer, attn="eager")
        config = _config(attention, override_config={"attn_implementation": "eager"})
    else:
        path, config = str(save_tiny_moe_model(tmp_path / arch, arch, tokenizer=tiny_tokenizer)), _config(attention)
    engine = build_fsdp_engine(path, config)
    assert len(engine.lora_experts) == 2 * sum(1 for n, _ in engine.module.named_modules() if n.endswith("mlp.experts"))
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert any("experts" in n and "lora_A" in n for n in trainable) and all("lora_" in n for n in trainable)
    batch = make_batch(len(tiny_tokenizer), batch_size=4)
    losses = [engine.train_batch(batch, seq_mean_nll)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]

    merged = dict(engine.named_full_params())  # what the rollout receives
    expected = copy.deepcopy(engine.module).merge_and_unload().state_dict()
    experts = [name for name in merged if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and set(merged) <= set(expected)
    for name in experts:
        assert torch.allclose(merged[name], expected[name], atol=1e-6), name
    base = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert max((merged[n] - base[n]).abs().max().item() for n in experts) > 1e-3  # the experts did change

    engine.save_hf_model(tmp_path / "export")  # the exported plain model computes what the adapted one does
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    ids = batch.batch["input_ids"][:, :8]
    engine.module.eval()
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, engine.module(input_ids=ids).logits, atol=1e-4)


def _two_steps(rank: int, world_size: int, path: str, out_file: str, experts: bool, ep: int) -> None:
    batch = make_batch(len(load_tokenizer(path)), batch_size=4)
    local = batch.chunk(world_size)[rank] if world_size > 1 else batch
    torch.manual_seed(0)  # lora_A's random start, alike in both runs
    config = _config(["q_proj", "v_proj"])
    model = config.model if experts else dataclasses.replace(config.model, target_parameters=None)
    engine = build_fsdp_engine(path, dataclasses.replace(config, model=model, fsdp=FSDPConfig(expert_parallel_size=ep)))
    losses = torch.tensor([engine.train_batch(local, seq_mean_nll)["loss"] for _ in range(2)], dtype=torch.float64)
    if world_size > 1:
        torch.distributed.all_reduce(losses)
    merged = {name: tensor.clone() for name, tensor in engine.named_full_params()}
    if rank == 0:
        torch.save(((losses / world_size).tolist(), merged), out_file)


@pytest.mark.parametrize(("experts", "ep"), [pytest.param(True, 1, marks=pytest.mark.slow), (False, 2)],
                         ids=["experts_fsdp2", "attention_ep2"])  # the default suite's GRPO run covers FSDP2 with them
def test_adapters_on_two_ranks_equal_one_process(tmp_path, tiny_tokenizer, experts, ep):
    """Adapters on attention and experts with FSDP2 over 2 ranks; or adapters on the attention of a model whose
    experts are split over the 2 ranks (expert parallelism). Each against one process holding everything."""
    path = str(save_tiny_moe_model(tmp_path / "mixtral", "mixtral", tokenizer=tiny_tokenizer))
    _two_steps(0, 1, path, str(tmp_path / "one.pt"), experts, 1)
    run_distributed(_two_steps, 2, path, str(tmp_path / "two.pt"), experts, ep)
    (losses, merged), (losses2, merged2) = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert losses2 == pytest.approx(losses, rel=1e-5)
    assert max((merged[n] - merged2[n]).abs().max().item() for n in merged) < 1e-4


@pytest.mark.parametrize(("extra", "message"), [
    (["actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2"],
     r"target_parameters.*expert_parallel_size=2.*not with expert parallelism"),
    (["actor_rollout_ref.model.lora_rank=0"], r"target_parameters=.* set lora_rank > 0"),
    (["actor_rollout_ref.model.target_parameters=[mlp.experts.up_proj]"], r"names no 3-D expert weight"),
])
def test_expert_adapter_settings_it_cannot_serve_are_refused_before_ray(tmp_path, tiny_tokenizer, extra, message):
    path = save_tiny_moe_model(tmp_path / "mixtral", "mixtral", tokenizer=tiny_tokenizer)
    train_file = write_rows(tmp_path / "train.parquet", ["gsm8k", "reasoning_gym/basic_arithmetic"] * 8)
    overrides = grpo_overrides(
        train_file, f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        f"actor_rollout_ref.model.target_parameters=[{','.join(EXPERTS)}]",
    )
    with nothing_started():
        validate_config(load_config(overrides))
        with pytest.raises(ValueError, match=message):
            validate_config(load_config(overrides + extra))


def test_expert_adapters_checkpoint_resume_and_merge(tmp_path, tiny_tokenizer):
    """The checkpoint's peft adapter keeps `target_parameters`: a run continued from it starts from the same
    adapters, and `hybridflow merge` exports what the engine hands to the rollout."""
    from hybridflow.engines.training.merge import merge_checkpoint
    from hybridflow.models.loader import build_causal_lm

    path = str(save_tiny_moe_model(tmp_path / "mixtral", "mixtral", tokenizer=tiny_tokenizer))
    engine = build_fsdp_engine(path, _config(["q_proj", "v_proj"]))
    engine.train_batch(make_batch(len(tiny_tokenizer), batch_size=4), seq_mean_nll)
    engine.save_checkpoint(tmp_path / "ckpt")
    resumed = build_fsdp_engine(path, dataclasses.replace(_config(["q_proj", "v_proj"]), model=ModelConfig(
        lora_rank=4, lora_adapter_path=str(tmp_path / "ckpt" / "lora_adapter"))))
    assert resumed.lora_scaling == engine.lora_scaling and resumed.lora_scaling.target_parameters == tuple(sorted(EXPERTS))
    trained = dict(engine.module.named_parameters())
    for name, param in resumed.module.named_parameters():
        assert torch.equal(param, trained[name]), name
    exported = build_causal_lm(merge_checkpoint(tmp_path / "ckpt", tmp_path / "merged")).state_dict()
    for name, tensor in engine.named_full_params():
        assert torch.equal(exported[name], tensor), name
