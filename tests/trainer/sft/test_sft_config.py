"""`hybridflow sft` config: verl's SFT keys, --dry-run and --cfg job, one-line errors naming the key (exit 2)."""

from __future__ import annotations

import pytest

from hybridflow.cli import main as cli_main
from hybridflow.trainer.config import SFT_TREE, load_config
from tests.trainer.sft.conftest import sft_overrides


def test_dry_run_prints_the_config_and_batch_arithmetic(sft_workspace, tmp_path, capsys):
    args = sft_overrides(sft_workspace, tmp_path, "trainer.n_gpus_per_node=2", "model.lora_rank=8",
                         "model.target_modules=[q_proj,v_proj]")
    assert cli_main(["sft", "--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert "path:" in out and "lora_rank: 8" in out and "- q_proj" in out
    assert "samples per rank                                 2" in out
    assert "gradient accumulation steps                      1" in out
    assert cli_main(["sft", "--cfg", "job", *args]) == 0
    assert "multiturn:" in capsys.readouterr().out
    cfg = load_config(args, SFT_TREE)
    assert cfg.model.lora_target_modules == ("q_proj", "v_proj") and cfg.optim.lr_scheduler_type == "cosine"


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("model.lora_rnk=8", ["lora_rnk", "unknown key"]),
        ("data.response_key=answer", ["has no 'answer' column (data.response_key)", "'response'"]),
        ("data.truncation=middle", ["data.truncation", "middle"]),
        ("optim.lr_scheduler=step", ["optim.lr_scheduler", "step"]),
        ("trainer.resume_mode=resume_path", ["trainer.resume_from_path"]),
        ("trainer.n_gpus_per_node=3", ["data.train_batch_size=4", "3 ranks"]),
        ("data.micro_batch_size_per_gpu=3", ["data.micro_batch_size_per_gpu=3", "divisor of 2"]),
        ("data.val_files=[/nope.parquet]", ["data.val_files", "/nope.parquet"]),
        ("model.partial_pretrain=/no/model", ["model.partial_pretrain", "/no/model"]),
        ("model.lora_rank=-1", ["model.lora_rank", "-1"]),
        ("trainer.local_mode=true", ["trainer.local_mode", "n_gpus_per_node=1"]),
        ("optim=megatron", ["optim=megatron selects verl's 'megatron' optim config group", "drop optim=megatron"]),
        ("model.strategy=megatron", ["model.strategy", "megatron"]),
        ("model.fsdp_config.forward_only=True", ["model.fsdp_config.forward_only=True: that role trains"]),
    ],
)
def test_config_errors_name_the_key(sft_workspace, tmp_path, capsys, override, words):
    args = sft_overrides(sft_workspace, tmp_path, "trainer.n_gpus_per_node=2", override)
    if override.startswith("trainer.n_gpus_per_node"):
        args.remove("trainer.n_gpus_per_node=2")
    assert cli_main(["sft", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridflow sft: config error:") and "\n" not in err
    for word in words:
        assert word in err, (word, err)


def test_verl_s_fsdp_sft_keys_are_taken(sft_workspace, tmp_path):
    """verl's fsdp_sft_trainer lines: the top-level use_remove_padding, model.strategy, and the optim group."""
    args = sft_overrides(sft_workspace, tmp_path, "use_remove_padding=true", "model.strategy=fsdp", "optim=fsdp",
                         "optim.lr=2e-5")
    cfg = load_config(args, SFT_TREE)
    assert cfg.model.use_remove_padding and cfg.model.strategy == "fsdp" and cfg.optim.lr == 2e-5
    assert not load_config(sft_overrides(sft_workspace, tmp_path), SFT_TREE).model.use_remove_padding


def test_ray_s_timeline_is_taken_and_never_written_over_a_file(sft_workspace, tmp_path, capsys):
    """SFT writes Ray's timeline at its end too (ray_kwargs.timeline_json_file), never over a file."""
    existing = tmp_path / "timeline.json"
    existing.write_text("{}")
    args = sft_overrides(sft_workspace, tmp_path, f"ray_kwargs.timeline_json_file={existing}")
    assert cli_main(["sft", *args]) == 2
    assert "timeline_json_file" in capsys.readouterr().err and existing.read_text() == "{}"


def test_verl_s_global_micro_batch_size_becomes_the_per_gpu_one(sft_workspace, tmp_path):
    """verl's sp2 SFT examples set the old global `data.micro_batch_size`: it is split over the data-parallel ranks
    (ranks / sequence-parallel size), as verl's RL workers split their global keys."""
    base = [arg for arg in sft_overrides(sft_workspace, tmp_path) if not arg.startswith("data.micro_batch_size_per_gpu")]
    cfg = load_config([*base, "data.micro_batch_size=4", "trainer.n_gpus_per_node=2"], SFT_TREE)
    assert (cfg.data.micro_batch_size_per_gpu, cfg.data.micro_batch_size) == (2, None)
    cfg = load_config([*base, "data.micro_batch_size=4", "trainer.n_gpus_per_node=2", "ulysses_sequence_parallel_size=2",
                       "use_remove_padding=true"], SFT_TREE)
    assert cfg.data.micro_batch_size_per_gpu == 4
    with pytest.raises(ValueError, match="data.micro_batch_size=4 and data.micro_batch_size_per_gpu=2 are both given"):
        load_config([*base, "data.micro_batch_size=4", "data.micro_batch_size_per_gpu=2"], SFT_TREE)
    with pytest.raises(ValueError, match="data.micro_batch_size=1 over 2 data-parallel ranks leaves less than one"):
        load_config([*base, "data.micro_batch_size=1", "trainer.n_gpus_per_node=2"], SFT_TREE)


def test_an_empty_file_and_a_resume_that_would_ignore_a_changed_lr_are_refused(sft_workspace, tmp_path, capsys):
    """A 0-row file passed --dry-run and failed in the run; a changed lr on resume was logged as the old one."""
    import json

    import pandas as pd

    empty = tmp_path / "empty.parquet"
    pd.read_parquet(sft_workspace / "train.parquet").iloc[:0].to_parquet(empty)
    args = sft_overrides(sft_workspace, tmp_path / "run", f"data.val_files=[{empty}]")
    args.remove(f"data.val_files=[{sft_workspace / 'val.parquet'}]")
    assert cli_main(["sft", "--dry-run", *args]) == 2
    assert f"data.val_files entry '{empty}' holds no rows" in capsys.readouterr().err
    step = tmp_path / "run" / "global_step_1"
    step.mkdir(parents=True)
    settings = {"model.path": str(sft_workspace / "tiny"), "optim.lr": 1e-2}
    (step / "driver_state.json").write_text(json.dumps({"global_steps": 1, "settings": settings}))
    assert cli_main(["sft", "--dry-run", *sft_overrides(sft_workspace, tmp_path / "run")]) == 0
    capsys.readouterr()
    assert cli_main(["sft", "--dry-run", *sft_overrides(sft_workspace, tmp_path / "run", "optim.lr=0.5")]) == 2
    assert "would ignore what the config changed (optim.lr: saved 0.01, now 0.5)" in capsys.readouterr().err


def test_a_validation_set_with_no_token_in_the_loss_is_an_error_not_a_perfect_loss():
    """Every response cut off by data.max_length (truncation='right'): the validation loss read 0.0."""
    from types import SimpleNamespace

    import torch

    from hybridflow.protocol import DataProto
    from hybridflow.trainer.sft.trainer import SFTTrainer

    def trainer(tokens: float) -> SimpleNamespace:
        output = DataProto.from_dict(tensors={"nll_sum": torch.tensor([2.0, 1.0]), "num_tokens": torch.tensor([tokens, 0.0])})
        batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
        return SimpleNamespace(val_loader=[batch], workers=SimpleNamespace(eval_loss=lambda data: output))

    assert SFTTrainer.validate(trainer(3.0)) == 1.0
    with pytest.raises(ValueError, match="no token in the loss"):
        SFTTrainer.validate(trainer(0.0))
