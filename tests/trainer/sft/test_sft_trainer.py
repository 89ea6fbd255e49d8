"""SFT end to end on a tiny model: local mode (learning, validation, atomic checkpoints, exact resume, multi-turn)
and 2 Ray ranks over gloo with LoRA (the same loss as 1 rank; adapter checkpoint; export to HF)."""

from __future__ import annotations

import pytest

import json
import shutil
from pathlib import Path

from transformers import AutoModelForCausalLM

from hybridflow.engines.training.merge import merge_checkpoint
from hybridflow.trainer.checkpoint_dirs import LATEST_FILE, list_steps
from hybridflow.trainer.sft import run_sft, validate_sft_config
from hybridflow.trainer.config import SFT_TREE, load_config
from tests.trainer.sft.conftest import sft_overrides


def run(args: list[str]) -> tuple[dict[str, float], dict[int, dict]]:
    cfg = load_config(args, SFT_TREE)
    validate_sft_config(cfg)
    summary = run_sft(cfg)
    records: dict[int, dict] = {}
    for line in (Path(cfg.trainer.default_local_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return summary, records


LOCAL = ("trainer.local_mode=true", "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2")


def test_local_sft_learns_validates_checkpoints_and_resumes_exactly(sft_workspace):
    full_dir = sft_workspace / "local_full"
    summary, full = run(sft_overrides(sft_workspace, full_dir, *LOCAL))
    assert sorted(full) == [0, 1, 2, 3, 4]
    assert summary["val/loss"] < summary["val/loss_before"] - 0.5, summary
    assert full[4]["train/loss"] < full[1]["train/loss"]
    assert full[2]["val/loss"] > full[4]["val/loss"] and "val/loss" not in full[3]
    assert full[1]["train/num_loss_tokens"] > 0 and full[1]["train/grad_norm"] > 0
    assert list_steps(full_dir) == [2, 4] and (full_dir / LATEST_FILE).read_text() == "4"

    # Resume from step 2 in a fresh directory: steps 3 and 4 reproduce the uninterrupted run bit for bit.
    resumed_dir = sft_workspace / "local_resumed"
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "global_step_2", resumed_dir / "global_step_2")
    (resumed_dir / LATEST_FILE).write_text("2")
    _, resumed = run(sft_overrides(sft_workspace, resumed_dir, *LOCAL))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/num_tokens"):
            assert resumed[step][key] == full[step][key], (step, key)
    assert resumed[4]["val/loss"] == full[4]["val/loss"]

    # The SFT checkpoint exports to a plain HF directory.
    target = merge_checkpoint(full_dir / "global_step_4", sft_workspace / "local_hf")
    assert AutoModelForCausalLM.from_pretrained(target).config.num_hidden_layers == 2


def test_token_budget_micro_batches_give_the_row_micro_batches_loss(sft_workspace):
    """data.use_dynamic_bsz (verl's engine-SFT key): micro-batches cut by tokens, the same loss and validation loss
    as micro-batches of rows (the loss is a mean over the step's tokens)."""
    steps = ("trainer.local_mode=true", "trainer.total_training_steps=2", "trainer.test_freq=2")
    _, by_rows = run(sft_overrides(sft_workspace, sft_workspace / "rows_budget", *steps))
    _, by_tokens = run(sft_overrides(sft_workspace, sft_workspace / "tokens_budget", *steps, "data.use_dynamic_bsz=true",
                                     "data.max_token_len_per_gpu=64"))
    for step in (1, 2):
        assert by_tokens[step]["train/loss"] == pytest.approx(by_rows[step]["train/loss"], rel=1e-5), step
    assert by_tokens[2]["val/loss"] == pytest.approx(by_rows[2]["val/loss"], rel=1e-5)
    with pytest.raises(ValueError, match="max_token_len_per_gpu=32 is below data.max_length=64"):
        load_config(sft_overrides(sft_workspace, sft_workspace / "x", "data.use_dynamic_bsz=true",
                                  "data.max_token_len_per_gpu=32"), SFT_TREE)


def test_multiturn_sft_trains_only_assistant_turns_padded_or_packed(sft_workspace):
    def args(name: str, *extra: str) -> list[str]:
        return sft_overrides(
            sft_workspace, sft_workspace / name, "trainer.local_mode=true", "trainer.total_training_steps=2",
            f"data.train_files=[{sft_workspace / 'chat.parquet'}]", "data.val_files=[]",
            "data.multiturn.enable=true", "data.shuffle=false", *extra,
        )

    summary, records = run(args("chat"))
    assert sorted(records) == [1, 2] and summary["train/loss"] == records[2]["train/loss"]
    # Batch 1 holds rows 0-3: two short chats (one assistant turn) and two with a tool turn (two assistant turns).
    from hybridflow.data.config import MultiturnConfig, SFTDataConfig
    from hybridflow.data.sft_dataset import SFTDataset
    from hybridflow.models import load_tokenizer

    dataset = SFTDataset(sft_workspace / "chat.parquet", load_tokenizer(sft_workspace / "tiny"),
                         SFTDataConfig(multiturn=MultiturnConfig(enable=True)))
    expected = sum(int(dataset[index]["loss_mask"].sum()) for index in range(4))
    assert records[1]["train/num_loss_tokens"] == expected
    # Packing the micro-batches (no padding) gives the same losses.
    _, packed = run(args("chat_packed", "model.use_remove_padding=true"))
    for step in (1, 2):
        assert abs(packed[step]["train/loss"] - records[step]["train/loss"]) < 1e-5, step


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_lora_sft_on_two_ray_ranks_matches_one_rank(sft_workspace, ray_cluster):
    lora = ("model.lora_rank=8", "model.lora_alpha=16", "trainer.total_training_steps=2", "trainer.val_before_train=false")
    _, one = run(sft_overrides(sft_workspace, sft_workspace / "lora_one", "trainer.local_mode=true", *lora))
    two_dir = sft_workspace / "lora_two"
    summary, two = run(sft_overrides(sft_workspace, two_dir, "trainer.n_gpus_per_node=2", *lora))
    for step in (1, 2):  # the loss is a token mean over the whole batch, however it is split over ranks
        assert abs(two[step]["train/loss"] - one[step]["train/loss"]) < 1e-5, step
        assert abs(two[step]["train/grad_norm"] - one[step]["train/grad_norm"]) < 1e-4, step
    assert abs(two[2]["val/loss"] - one[2]["val/loss"]) < 1e-5
    checkpoint = two_dir / "global_step_2"
    assert (checkpoint / "lora_adapter" / "adapter_config.json").is_file()
    assert (checkpoint / "model_world_size_2_rank_1.pt").is_file()
    target = merge_checkpoint(checkpoint, sft_workspace / "lora_hf")
    assert not (target / "adapter_config.json").exists()
    AutoModelForCausalLM.from_pretrained(target)


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_tensor_and_sequence_parallel_sft_on_two_ray_ranks_match_one_rank(sft_workspace, ray_cluster):
    common = ("model.use_remove_padding=true", "trainer.total_training_steps=2", "trainer.val_before_train=false")
    _, one = run(sft_overrides(sft_workspace, sft_workspace / "par_one", "trainer.local_mode=true", *common))
    layouts = {"tp2": "model.fsdp_config.tensor_parallel_size=2", "sp2": "ulysses_sequence_parallel_size=2"}
    for name, layout in layouts.items():
        run_dir = sft_workspace / f"par_{name}"
        _, two = run(sft_overrides(sft_workspace, run_dir, "trainer.n_gpus_per_node=2", layout, *common))
        for step in (1, 2):  # both ranks take the whole batch: the same token mean as one rank
            assert abs(two[step]["train/loss"] - one[step]["train/loss"]) < 1e-5, (name, step)
            assert abs(two[step]["train/grad_norm"] - one[step]["train/grad_norm"]) < 1e-4, (name, step)
        assert abs(two[2]["val/loss"] - one[2]["val/loss"]) < 1e-5, name
    target = merge_checkpoint(sft_workspace / "par_tp2" / "global_step_2", sft_workspace / "par_tp2_hf")
    AutoModelForCausalLM.from_pretrained(target)


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_expert_parallel_sft_on_two_ray_ranks_matches_one_rank(sft_workspace, ray_cluster):
    """SFT of a tiny Qwen3-MoE with model.fsdp_config.expert_parallel_size=2 on 2 Ray ranks (each holds half the
    experts; the ranks take different rows) equals one rank, and its checkpoint merges into a loadable model."""
    from hybridflow.models import load_tokenizer
    from hybridflow.models.moe import save_tiny_moe_model

    moe_dir = save_tiny_moe_model(sft_workspace / "tiny_moe", "qwen3_moe", tokenizer=load_tokenizer(sft_workspace / "tiny"))

    def overrides(run_dir, *extra):
        base = sft_overrides(sft_workspace, run_dir, "model.use_remove_padding=true", "trainer.total_training_steps=2",
                             "trainer.val_before_train=false", *extra)
        return [f"model.partial_pretrain={moe_dir}" if item.startswith("model.partial_pretrain=") else item
                for item in base]

    _, one = run(overrides(sft_workspace / "ep_one", "trainer.local_mode=true"))
    _, two = run(overrides(sft_workspace / "ep_two", "trainer.n_gpus_per_node=2",
                           "model.fsdp_config.expert_parallel_size=2"))
    assert abs(two[1]["train/loss"] - one[1]["train/loss"]) < 1e-5
    # After one AdamW step near-zero expert gradients' float-order noise moves weights by ~lr either way (as in
    # tests/engines/training/test_moe_engine.py): the second loss agrees to 1e-5 relative (measured 3e-6).
    assert two[2]["train/loss"] == pytest.approx(one[2]["train/loss"], rel=1e-5)
    for step in (1, 2):
        assert abs(two[step]["train/grad_norm"] - one[step]["train/grad_norm"]) < 1e-4, step
    target = merge_checkpoint(sft_workspace / "ep_two" / "global_step_2", sft_workspace / "ep_two_hf")
    AutoModelForCausalLM.from_pretrained(target)


def test_verl_s_checkpoint_contents_add_a_full_hf_directory(sft_workspace):
    """verl's e2e SFT line saves trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]: the checkpoint
    holds a transformers-loadable model beside its shards."""
    run_dir = sft_workspace / "local_hf_contents"
    run(sft_overrides(sft_workspace, run_dir, "trainer.local_mode=true", "trainer.total_training_steps=1",
                      "trainer.save_freq=1", "trainer.test_freq=-1",
                      "trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]"))
    checkpoint = run_dir / "global_step_1"
    assert AutoModelForCausalLM.from_pretrained(checkpoint / "huggingface_full").config.num_hidden_layers == 2
    assert any(checkpoint.glob("optim_world_size_1_rank_0.pt"))
