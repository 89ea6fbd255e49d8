"""`hybridflow merge`: sharded checkpoints (2 ranks, 1 rank; full weights and LoRA) -> HF directories whose
logits equal the trained model's; plus the LoRA weight hand-over to a rollout on 2 sharded ranks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.cli import main as cli_main
from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPEngine, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.merge import merge_checkpoint
from hybridflow.models import build_causal_lm, build_local_tokenizer, build_tiny_model, load_tokenizer, save_tiny_model
from hybridflow.models.config import ModelConfig
from tests.engines.helpers import make_batch, run_distributed, seq_mean_nll

FULL = FSDPEngineConfig(micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2))
LORA = FSDPEngineConfig(
    micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2), model=ModelConfig(lora_rank=8, lora_alpha=16)
)


def _trained_params(engine: FSDPEngine, batch) -> dict[str, torch.Tensor]:
    """One step, then the full plain-HF weights (merged for LoRA) on CPU (collective)."""
    engine.train_batch(batch, seq_mean_nll)
    return {name: tensor.clone().cpu() for name, tensor in engine.named_full_params()}


def _two_rank_scenario(rank: int, world_size: int, model_dir: str, root: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    batch = make_batch(len(tokenizer), batch_size=4, seed=1).chunk(world_size)[rank]
    for name, config in (("full", FULL), ("lora", LORA)):
        engine = build_fsdp_engine(model_dir, config, tokenizer=tokenizer)
        assert engine.is_sharded
        params = _trained_params(engine, batch)
        engine.save_checkpoint(f"{root}/{name}_ckpt")
        if rank == 0:
            torch.save(params, f"{root}/{name}_params.pt")
    # LoRA weight hand-over: a rollout built from other weights receives the merged weights gathered from the
    # shards and then computes the same log-probs as the sharded LoRA policy.
    rollout_model, _ = build_tiny_model(seed=99, tokenizer=tokenizer)
    rollout = HFRollout(rollout_model, tokenizer, SamplingParams(max_new_tokens=4))
    rollout.update_weights(engine.named_full_params())
    policy_log_probs, _ = engine.compute_log_prob(batch)
    handed_over, _ = FSDPEngine(rollout.model, FSDPEngineConfig()).compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    assert (handed_over - policy_log_probs)[mask].abs().max() < 1e-5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    model_dir = str(save_tiny_model(root / "tiny", tokenizer=build_local_tokenizer()))
    run_distributed(_two_rank_scenario, 2, model_dir, str(root))
    return root, model_dir


def logits_of(model_dir_or_model, input_ids: torch.Tensor) -> torch.Tensor:
    model = model_dir_or_model
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, use_cache=False).logits


def reference_logits(model_dir: str, params: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    model = build_causal_lm(model_dir)
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return logits_of(model, input_ids)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_rank_checkpoint_round_trips_to_hf(workspace, kind):
    root, model_dir = workspace
    params = torch.load(root / f"{kind}_params.pt")
    target = merge_checkpoint(root / f"{kind}_ckpt", root / f"{kind}_hf")
    input_ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    merged = logits_of(target, input_ids)
    torch.testing.assert_close(merged, reference_logits(model_dir, params, input_ids), rtol=0, atol=1e-6)
    assert not torch.allclose(merged, logits_of(model_dir, input_ids), atol=1e-3), "training changed the model"
    # A plain HF directory: tokenizer included, no peft files, generation works.
    assert not (target / "adapter_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target)
    prompt = tokenizer("What is 12 + 7?", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert output.shape[1] > prompt["input_ids"].shape[1]


@pytest.mark.parametrize("config", [FULL, LORA], ids=["full", "lora"])
def test_one_rank_checkpoint_round_trips_through_the_cli(workspace, tmp_path, config):
    _, model_dir = workspace
    tokenizer = load_tokenizer(model_dir)
    engine = build_fsdp_engine(model_dir, config, tokenizer=tokenizer)
    params = _trained_params(engine, make_batch(len(tokenizer), batch_size=4, seed=2))
    engine.save_checkpoint(tmp_path / "global_step_1" / "actor")
    # An RL global_step_N directory is accepted as well (its actor/ holds the shards); verl's spelling works.
    assert cli_main(["merge", "merge", "--backend", "fsdp", "--local_dir", str(tmp_path / "global_step_1"),
                     "--target_dir", str(tmp_path / "hf")]) == 0
    input_ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits_of(tmp_path / "hf", input_ids), reference_logits(model_dir, params, input_ids),
                               rtol=0, atol=1e-6)


def test_verl_s_quickstart_merges_into_the_checkpoint_s_own_huggingface_directory(workspace, tmp_path, capsys):
    """`python -m verl.model_merger merge ... --target_dir global_step_1/actor/huggingface`: the weights join the
    config and tokenizer there, which stay as saved; a second merge finds the weights and writes nothing."""
    import subprocess
    import sys

    _, model_dir = workspace
    tokenizer = load_tokenizer(model_dir)
    engine = build_fsdp_engine(model_dir, FULL, tokenizer=tokenizer)
    params = _trained_params(engine, make_batch(len(tokenizer), batch_size=4, seed=3))
    actor = tmp_path / "global_step_1" / "actor"
    engine.save_checkpoint(actor)
    hf_dir = actor / "huggingface"
    saved = {entry.name: entry.read_bytes() for entry in hf_dir.iterdir()}
    command = [sys.executable, "-m", "hybridflow.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor),
               "--target_dir", str(hf_dir)]
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0
    assert all((hf_dir / name).read_bytes() == content for name, content in saved.items())
    input_ids = torch.randint(3, 400, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits_of(hf_dir, input_ids), reference_logits(model_dir, params, input_ids),
                               rtol=0, atol=1e-6)
    before = sorted(entry.name for entry in hf_dir.iterdir())
    assert cli_main(["merge", "--local_dir", str(actor), "--target_dir", str(hf_dir)]) == 1
    assert "already holds model weights" in capsys.readouterr().err
    assert sorted(entry.name for entry in hf_dir.iterdir()) == before


def test_merge_refuses_a_non_empty_target_and_incomplete_checkpoints(workspace, tmp_path, capsys):
    root, _ = workspace
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert cli_main(["merge", "--local_dir", str(root / "full_ckpt"), "--target_dir", str(target)]) == 1
    assert f"--target_dir {target} exists and is not empty" in capsys.readouterr().err
    assert (target / "keep.txt").read_text() == "mine" and len(list(target.iterdir())) == 1
    with pytest.raises(FileNotFoundError, match="holds no model_world_size_W_rank_R.pt"):
        merge_checkpoint(tmp_path, tmp_path / "out")
    partial = tmp_path / "partial"
    partial.mkdir()
    shard = "model_world_size_2_rank_0.pt"
    (partial / shard).write_bytes((root / "full_ckpt" / shard).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\] \(of world size 2\) are missing"):
        merge_checkpoint(partial, tmp_path / "out")
    assert not (tmp_path / "out").exists()
