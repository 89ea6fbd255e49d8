"""verl's engine-based SFT (`verl.trainer.sft_trainer`, sft_trainer_engine.yaml) with the module name changed:
its keys (engine.*, checkpoint.*, data.messages_key, data.pad_mode, engine=/optim= groups) and defaults, its
refusals, and trainer.test_freq=after_each_epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.loader import SFT_ENGINE_TREE
from hybridflow.trainer.sft import run_sft, validate_sft_config
from hybridflow.trainer.sft_trainer import main as engine_sft_main
from tests.helpers import nothing_started


@pytest.fixture(scope="module")
def chats(sft_workspace, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("engine_sft") / "chats.parquet"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_line(workspace, chats, run_dir, *extra: str) -> list[str]:
    """verl's tests/special_e2e/sft/run_sft_engine.sh (fsdp backend) with this machine's model, data and sizes."""
    return [
        f"data.train_files={chats}", f"data.val_files={chats}", "data.train_batch_size=8", "data.pad_mode=no_padding",
        "data.truncation=error", "data.use_dynamic_bsz=True", "data.max_token_len_per_gpu=2048",
        "data.messages_key=messages", f"model.path={workspace / 'tiny'}", "model.use_remove_padding=True",
        "engine=fsdp", "optim=fsdp", "optim.lr=1e-5", "optim.lr_warmup_steps_ratio=0.2", "optim.weight_decay=0.1",
        "optim.betas=[0.9,0.95]", "optim.clip_grad=1.0", "optim.min_lr_ratio=0.1", "optim.lr_scheduler_type=cosine",
        "engine.ulysses_sequence_parallel_size=1", "engine.strategy=fsdp", "engine.fsdp_size=1",
        "trainer.test_freq=after_each_epoch", "trainer.save_freq=-1", "trainer.logger=['console','file']",
        "trainer.project_name=verl_sft_test", "trainer.experiment_name=gsm8k-fsdp", "trainer.total_epochs=2",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        *extra,
    ]


def test_verl_s_engine_sft_line_maps_onto_the_sft_config(sft_workspace, chats, tmp_path, capsys):
    args = verl_line(sft_workspace, chats, tmp_path / "run", "checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    with nothing_started():
        assert engine_sft_main(["--dry-run", *args]) == 0
    assert "tokens per micro-batch (max_token_len_per_gpu)  2048" in capsys.readouterr().out
    cfg = load_config(args, SFT_ENGINE_TREE)
    assert cfg.data.multiturn.enable and cfg.data.multiturn.messages_key == "messages" and cfg.data.token_budget == 2048
    assert cfg.model.fsdp_config.fsdp_size == 1 and cfg.model.fsdp_config.strategy == "fsdp"
    assert (cfg.optim.lr, cfg.optim.lr_scheduler_type, cfg.optim.betas) == (1e-5, "cosine", (0.9, 0.95))
    assert cfg.trainer.test_freq == "after_each_epoch" and "hf_model" in cfg.trainer.checkpoint.save_contents


def test_the_engine_sft_defaults_are_verl_s(sft_workspace, chats, tmp_path):
    cfg = load_config([f"data.train_files={chats}", f"model.path={sft_workspace / 'tiny'}"], SFT_ENGINE_TREE)
    assert (cfg.optim.lr, cfg.optim.lr_scheduler_type, cfg.optim.lr_warmup_steps_ratio) == (1e-3, "constant", 0.0)
    assert cfg.data.use_dynamic_bsz and cfg.data.max_token_len_per_gpu == 8192 and cfg.data.pad_mode == "no_padding"
    assert cfg.data.multiturn.enable and cfg.model.use_remove_padding and cfg.model.enable_gradient_checkpointing


@pytest.mark.parametrize("extra, message", [
    (("engine=megatron",), "engine=megatron selects verl's 'megatron' engine config group"),
    (("model.use_remove_padding=False",), "data.pad_mode=no_padding computes on no padding"),
    (("data.balance_dp_token=True",), "data.balance_dp_token"),
])
def test_engine_sft_settings_hybridflow_cannot_honour_are_refused(sft_workspace, chats, tmp_path, extra, message):
    with nothing_started(), pytest.raises(ValueError, match=message):
        validate_sft_config(load_config(verl_line(sft_workspace, chats, tmp_path / "run", *extra), SFT_ENGINE_TREE))


def test_a_config_error_names_the_key_as_the_line_wrote_it(sft_workspace, chats, tmp_path, capsys):
    assert engine_sft_main(verl_line(sft_workspace, chats, tmp_path / "run", "engine.param_offload=maybe")) == 2
    assert "config error: engine.param_offload='maybe' must be bool" in capsys.readouterr().err


def test_after_each_epoch_validates_at_each_epoch_s_end(sft_workspace, chats, tmp_path):
    run_dir = tmp_path / "run"
    args = verl_line(sft_workspace, chats, run_dir, "trainer.local_mode=true", "trainer.total_training_steps=null",
                     "data.train_batch_size=8")  # 16 rows: 2 steps an epoch, 2 epochs
    cfg = load_config(args, SFT_ENGINE_TREE)
    validate_sft_config(cfg)
    run_sft(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(record["step"] for record in records if "val/loss" in record) == [0, 2, 4]
    assert max(record["step"] for record in records) == 4


def test_rows_with_images_are_refused_not_trained_without_them(sft_workspace, tmp_path):
    """verl's VLM SFT lines (examples/sft/vlm): the rows' images would be dropped, so they are refused by name."""
    rows = [{"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A cat."}],
             "images": [{"bytes": b"\x89PNG"}]}]
    path = tmp_path / "vlm.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with nothing_started(), pytest.raises(ValueError, match=r"column 'images' holds images, but hybridflow's SFT trains"):
        validate_sft_config(load_config([f"data.train_files={path}", f"model.path={sft_workspace / 'tiny'}"],
                                        SFT_ENGINE_TREE))
