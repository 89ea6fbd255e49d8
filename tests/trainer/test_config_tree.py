"""The config tree: verl command lines run unchanged under --dry-run, every documented key exists and is
settable, verl's interpolations hold, invalid values fail fast naming the key, and --help lists every key."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from hybridflow.algorithms.policy_loss_registry import loss_hyperparameters
from hybridflow.trainer.config import PPO_TREE, SFT_TREE, load_config, validate_config
from hybridflow.trainer.config.loader import EVALUATION_TREE, GENERATION_TREE, SFT_ENGINE_TREE
from hybridflow.trainer.config.help import config_reference, format_help
from hybridflow.trainer.main_ppo import main as train_main
from hybridflow.trainer.sft.main import main as sft_main
from hybridflow.utils.config import describe_fields
from tests.helpers import nothing_started, write_rows

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture()
def files(tmp_path):
    """Train/val parquet files and a model directory (config checks read config.json and look for a weights file)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (model / "model.safetensors").write_bytes(b"")
    weightless = tmp_path / "global_step_1" / "huggingface"  # what a checkpoint's huggingface/ folder holds
    weightless.mkdir(parents=True)
    (weightless / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return {
        "weightless": str(weightless),
        # a `response` column too: the SFT dry runs below read the same files (data.prompt_key / response_key)
        "train": write_rows(tmp_path / "train.parquet", ["gsm8k", "math"] * 1024, response=["4"] * 2048),
        "val": write_rows(tmp_path / "test.parquet", ["gsm8k"], response=["4"]),
        "model": str(model),
    }


def verl_lines(f: dict[str, str]) -> dict[str, list[str]]:
    """verl example command lines (examples/ppo_trainer, grpo_trainer, ...) with the module name changed; the
    model path, rollout engine and logger are what this machine has."""
    common = [f"data.val_files={f['val']}", f"actor_rollout_ref.model.path={f['model']}", "actor_rollout_ref.rollout.name=hf"]
    return {
        "ppo_quickstart": common + [
            f"data.train_files={f['train']}", "data.train_batch_size=256", "data.max_prompt_length=512",
            "data.max_response_length=256", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-5",
            f"critic.model.path={f['model']}", "critic.ppo_micro_batch_size_per_gpu=4", "algorithm.kl_ctrl.kl_coef=0.001",
            "trainer.logger=console", "trainer.val_before_train=False", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
            "trainer.save_freq=10", "trainer.test_freq=10", "trainer.total_epochs=15",
        ],
        "ppo_gae_critic_offload": common + [
            f"data.train_files=[{f['train']}]", "algorithm.adv_estimator=gae", "data.train_batch_size=1024",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "critic.model.use_remove_padding=True", "critic.model.enable_gradient_checkpointing=True",
            "critic.model.fsdp_config.param_offload=False", "critic.model.fsdp_config.optimizer_offload=False",
            "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.n_gpus_per_node=8",
            "trainer.logger=['console','tensorboard']",
        ],
        "grpo": common + [
            "algorithm.adv_estimator=grpo", f"data.train_files={f['train']}", "data.train_batch_size=1024",
            "data.max_prompt_length=512", "data.max_response_length=1024", "data.filter_overlong_prompts=True",
            "data.truncation='error'", "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
            "trainer.critic_warmup=0", "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen2_7b",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
            "trainer.total_epochs=15",
        ],
        "dapo_knobs": common + [
            "algorithm.adv_estimator=grpo", f"data.train_files={f['train']}", "data.train_batch_size=16",
            "data.max_response_length=256", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio_c=10.0",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean", "actor_rollout_ref.actor.use_kl_loss=False",
            "algorithm.use_kl_in_reward=False", "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=64",
            "reward_model.overlong_buffer.penalty_factor=1.0", "algorithm.filter_groups.enable=False",
            "trainer.n_gpus_per_node=2",
        ],
        "dapo_dynamic_sampling": common + [  # tests/special_e2e/run_dapo.sh's knobs
            "algorithm.adv_estimator=grpo", f"data.train_files={f['train']}", "reward_model.reward_manager=dapo",
            "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "data.max_prompt_length=256", "data.max_response_length=256", "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=128", "reward_model.overlong_buffer.penalty_factor=1.0",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean", "data.train_batch_size=16", "data.gen_batch_size=64",
            "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=seq_reward",
            "algorithm.filter_groups.max_num_gen_batches=10", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.n_gpus_per_node=2", "trainer.total_epochs=2", "trainer.total_training_steps=1",
        ],
        "remax": common + [
            "algorithm.adv_estimator=remax", f"data.train_files={f['train']}", "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
            "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.kl_coef=0.001",
        ],
        "rloo": common + [
            "algorithm.adv_estimator=rloo", f"data.train_files={f['train']}", "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "algorithm.use_kl_in_reward=True",
            "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.kl_coef=0.001", "trainer.n_gpus_per_node=2",
        ],
        "reinforce_plus_plus": common + [
            "algorithm.adv_estimator=reinforce_plus_plus", f"data.train_files=[{f['train']},{f['train']}]",
            "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_type=mse", "actor_rollout_ref.rollout.n=8", "algorithm.gamma=1.0",
            "trainer.n_gpus_per_node=4",
        ],
        "actor_keys_only_gae": [
            f"data.train_files={f['train']}", f"actor_rollout_ref.model.path={f['model']}", "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        ],
        "ppo_sandbox_fusion": common + [  # examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh, on PRIME's data
            "reward_model.sandbox_fusion.url='https://sandbox.example/run_code'",
            "reward_model.sandbox_fusion.max_concurrent=128", "reward_model.reward_manager=prime",
            "algorithm.adv_estimator=gae", f"data.train_files={f['train']}", "data.train_batch_size=1024",
            "data.max_prompt_length=512", "data.max_response_length=512", "data.filter_overlong_prompts=True",
            "data.truncation='error'", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", "critic.optim.lr=1e-5",
            "critic.model.use_remove_padding=True", f"critic.model.path={f['model']}",
            "critic.model.enable_gradient_checkpointing=True", "critic.ppo_micro_batch_size_per_gpu=32",
            "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=console",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=1",
            "trainer.total_epochs=15",
        ],
    }


@pytest.mark.parametrize("name", list(verl_lines({"train": "", "val": "", "model": ""})))
def test_verl_command_lines_pass_dry_run(files, name, capsys):
    assert train_main(["--dry-run", *verl_lines(files)[name]]) == 0, capsys.readouterr().err
    assert "gradient accumulation steps" in capsys.readouterr().out


def test_keys_set_only_on_the_actor_reach_the_critic_and_ref(files):
    cfg = load_config(verl_lines(files)["actor_keys_only_gae"])
    sizes = validate_config(cfg)
    assert cfg.critic.ppo_mini_batch_size == 8 and cfg.critic.ppo_micro_batch_size_per_gpu == 2
    assert cfg.critic.forward_micro_batch_size_per_gpu == 2 and cfg.critic.ppo_epochs == 2
    assert cfg.critic.loss_agg_mode == "seq-mean-token-mean" and cfg.critic.model.path == files["model"]
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 2
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 2
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length
    assert sizes["critic"].optimizer_steps_per_step == 4  # 16 / 8 mini-batches x 2 epochs


def test_an_explicit_value_breaks_the_interpolation(files):
    cfg = load_config(verl_lines(files)["actor_keys_only_gae"] + ["critic.ppo_mini_batch_size=4", "critic.grad_clip=0.5"])
    assert cfg.critic.ppo_mini_batch_size == 4 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert cfg.critic.optim.clip_grad == 0.5  # optim.clip_grad follows grad_clip


def test_string_and_list_file_keys_are_the_same(files):
    single = load_config([f"data.train_files={files['train']}"]).data.train_files
    listed = load_config([f"data.train_files=[{files['train']}]"]).data.train_files
    assert single == listed == [files["train"]]


def test_loss_hyperparameters_from_the_docs_are_settable(files):
    cfg = load_config([
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001", "actor_rollout_ref.actor.tau_pos=2.0",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.01", "actor_rollout_ref.actor.loss_scale_factor=128",
    ])
    params = loss_hyperparameters(cfg.actor_rollout_ref.actor)
    assert (params["clip_cov_ratio"], params["tau_pos"], params["kl_cov_ratio"]) == (0.001, 2.0, 0.01)
    assert params["loss_scale_factor"] == 128.0 and "ppo_mini_batch_size" not in params


def _documented_keys() -> set[str]:
    """Every full config key named in README.md and docs/*.md (docs/algorithms.md's `actor.x` short forms too)."""
    roots = "data|actor_rollout_ref|critic|algorithm|trainer|reward_model|custom_reward_function|ray_kwargs"
    keys = set()
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path.name == "config.md":
            continue
        text = path.read_text()
        keys |= set(re.findall(rf"\b(?:{roots})(?:\.[a-z_0-9]+)+", text))
        keys |= {f"actor_rollout_ref.{key}" for key in re.findall(r"`(actor\.[a-z_.]+)`", text)}
    return keys


def test_every_documented_key_is_in_the_tree_and_passes_dry_run(files, capsys):
    # hybridflow generate's and score's keys count as documented keys too; their dry runs need files of their own
    # (test_generate.py, test_main_eval.py)
    trees = [(tree, {item.key: item for item in describe_fields(tree.root, derived=tree.derived)})
             for tree in (PPO_TREE, SFT_TREE, GENERATION_TREE, EVALUATION_TREE, SFT_ENGINE_TREE)]
    sections = {key.rpartition(".")[0] for _, leaves in trees for key in leaves}
    documented = _documented_keys()
    assert "actor_rollout_ref.actor.policy_loss.clip_cov_ratio" in documented  # the scan reads docs/algorithms.md
    not_keys = ("trainer.main_ppo", "trainer.main_generation", "trainer.main_eval", "trainer.fsdp_sft_trainer",
                "trainer.sft_trainer", "data.preprocess", "reward_model.ground_truth",
                "critic.update_critic", "critic.compute_values")
    # names under a free-form mapping (custom_reward_function.reward_kwargs.NAME) are the user's, not the tree's
    mappings = tuple(f"{key}." for _, leaves in trees for key, item in leaves.items() if isinstance(item.default, dict))
    aliases = [alias for tree, _ in trees for alias in tree.aliases]  # verl's spellings, rewritten to tree keys
    unknown = sorted(key for key in documented if not any(key in leaves for _, leaves in trees)
                     and key not in sections and not key.startswith(not_keys) and not key.startswith(mappings)
                     and not any(alias == key or alias.startswith(key + ".") for alias in aliases))
    assert not unknown, f"documented keys missing from the config tree: {unknown}"
    # Every documented key of a tree written out at its default, all in one command line: the dry run passes and
    # each key reads back its default. Only when the whole line fails is each key tried alone, to name the culprit.
    for tree, leaves in trees[:2]:
        main = train_main if tree is PPO_TREE else sft_main
        written = {}
        for key in sorted(documented & set(leaves)):
            default = [files["train"]] if key == "data.train_files" else leaves[key].default  # [] is refused
            written[key] = (default, json.dumps(default) if not isinstance(default, str) else f"'{default}'")
        overrides = [f"data.train_files={files['train']}", *(f"{key}={value}" for key, (_, value) in written.items())]
        if main(["--dry-run", *overrides]) != 0:
            capsys.readouterr()
            failing = [key for key, (_, value) in written.items()
                       if main(["--dry-run", f"data.train_files={files['train']}", f"{key}={value}"]) != 0]
            raise AssertionError(f"documented keys whose default fails a dry run: {failing or 'only together'}")
        config = load_config(overrides, tree)
        for key, (default, _) in written.items():
            node = config
            for part in key.split("."):
                node = getattr(node, part)
            expected = [default] if key.endswith("_files") and isinstance(default, str) else default
            assert node == expected or isinstance(default, str) and "${" in default, key
        assert len(written) > 10, "the scan found the documented keys of this tree"


INVALID = [
    ("actor_rollout_ref.actor.clip_ratio_c=0.5", ["actor_rollout_ref.actor.clip_ratio_c", "> 1"]),
    ("algorithm.gamma=1.5", ["algorithm.gamma", "[0.0, 1.0]"]),
    ("algorithm.lam=-0.1", ["algorithm.lam", "[0.0, 1.0]"]),
    ("algorithm.kl_ctrl.target_kl=0", ["algorithm.kl_ctrl.target_kl", "> 0"]),
    ("trainer.critic_warmup=5 trainer.total_training_steps=5 algorithm.adv_estimator=gae", ["trainer.critic_warmup=5"]),
    ("trainer.critic_warmup=200 algorithm.adv_estimator=gae", ["trainer.critic_warmup=200", "2 steps"]),
    ("data.train_batch_size=4096", ["data.train_batch_size=4096", "2048 training rows"]),
    ("critic.model.path=/nonexistent/critic algorithm.adv_estimator=gae", ["critic.model.path", "/nonexistent/critic"]),
    ("actor_rollout_ref.model.tokenizer_path=/nonexistent/tok", ["actor_rollout_ref.model.tokenizer_path"]),
    ("trainer.resume_mode=resume_path trainer.resume_from_path=/nonexistent/global_step_3", ["trainer.resume_from_path"]),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", ["tensor_model_parallel_size=2", "does not divide the 1 ranks"]),
    ("rollout.n_gpus_per_node=4", ["rollout.n_gpus_per_node=4", "actor_rollout_ref.hybrid_engine=False"]),
    ("actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=500",
     ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=500", "longest sequence", "1024"]),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
     ["ulysses_sequence_parallel_size=2", "over 1 ranks", "multiple of it"]),
    ("reward_model.enable=True", ["reward_model.model.path", "not a reward model", "ForSequenceClassification"]),
    ("reward_model.rule_reward_coef=0.5", ["reward_model.rule_reward_coef=0.5", "reward_model.enable=False"]),
    ("reward_model.micro_batch_size=4 reward_model.micro_batch_size_per_gpu=2",
     ["reward_model.micro_batch_size=4", "reward_model.micro_batch_size_per_gpu=2 are both given"]),
    # verl's docs/algo/ppo.md: the per-GPU size written at hybridflow's default still counts as given
    ("actor_rollout_ref.actor.ppo_micro_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
     ["actor_rollout_ref.actor.ppo_micro_batch_size=2", "ppo_micro_batch_size_per_gpu=4 are both given"]),
    ("data.gen_batch_size=32", ["data.gen_batch_size=32", "algorithm.filter_groups.enable=True"]),
    ("algorithm.filter_groups.enable=True algorithm.filter_groups.metric=seq_final_reward algorithm.use_kl_in_reward=True",
     ["filter_groups.metric=seq_final_reward", "metric=seq_reward"]),
    ("algorithm.filter_groups.max_num_gen_batches=-1", ["algorithm.filter_groups.max_num_gen_batches=-1", "no limit"]),
    ("algorithm.filter_groups.enable=True data.gen_batch_size=4096", ["data.gen_batch_size=4096", "training rows"]),
    ("actor_rollout_ref.ref.model.path=/nonexistent/teacher actor_rollout_ref.actor.use_kl_loss=True",
     ["actor_rollout_ref.ref.model.path", "/nonexistent/teacher"]),
    ("actor_rollout_ref.ref.model.lora_rank=4", ["actor_rollout_ref.ref.model.lora_rank=4", "frozen"]),
    ("actor_rollout_ref.model.path=WEIGHTLESS", ["actor_rollout_ref.model.path", "holds no weights", "hybridflow merge"]),
    ("actor_rollout_ref.actor.grad_clip=0.5 actor_rollout_ref.actor.optim.clip_grad=2.0", ["grad_clip", "clip_grad"]),
    ("reward_model.overlong_buffer.enable=True", ["reward_model.overlong_buffer.enable", "reward_manager=dapo"]),
    ("ray_init.num_cpus=4", ["ray_init.num_cpus", "ray_kwargs.ray_init.num_cpus"]),
    ("critic.fsdp_config.param_offload=True", ["critic.model.fsdp_config.param_offload"]),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=exp", ["lr_scheduler_type", "cosine"]),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[optimizer]", ["load_contents", "leaves out model"]),
    ("critic.checkpoint.save_contents=[]", ["save_contents", "at least one"]),
    ("algorithm.rollout_correction.rollout_is=tokens", ["algorithm.rollout_correction.rollout_is=", "'sequence'"]),
    ("algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=0",
     ["algorithm.rollout_correction.rollout_is_threshold=0", "> 0"]),
    ("algorithm.rollout_correction.rollout_rs=geometric algorithm.rollout_correction.rollout_rs_threshold=2",
     ["algorithm.rollout_correction.rollout_rs='geometric'", "unknown rule", "seq_mean_k1"]),
    ("algorithm.rollout_correction.rollout_rs=token_k1", ["algorithm.rollout_correction.rollout_rs_threshold=<bounds>"]),
    ("algorithm.rollout_correction.rollout_rs=token_k1 algorithm.rollout_correction.rollout_rs_threshold=2.0_0.5",
     ["algorithm.rollout_correction.rollout_rs_threshold='2.0_0.5'", "lower ratio 2 above upper 0.5"]),
    ("algorithm.rollout_correction.rollout_is_batch_normalize=True",
     ["algorithm.rollout_correction.rollout_is_batch_normalize=True", "rollout_is is null"]),
    ("algorithm.rollout_correction.loss_type=reinforce", ["algorithm.rollout_correction.loss_type='reinforce'",
                                                          "set algorithm.rollout_correction.bypass_mode=True"]),
]


@pytest.mark.parametrize(("override", "words"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_values_fail_in_under_a_second_naming_the_key(files, override, words):
    override = override.replace("WEIGHTLESS", files["weightless"])
    overrides = verl_lines(files)["dapo_knobs"][:3] + [f"data.train_files={files['train']}"] + override.split(" ")
    with nothing_started(), pytest.raises(ValueError) as info:
        validate_config(load_config(overrides))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_paths_expand_home_like_the_loader(files, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config([
        "data.train_files='~/train.parquet'", "actor_rollout_ref.model.path='~/model'",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ])
    validate_config(cfg)  # both exist only once ~ is expanded


@pytest.mark.parametrize(("source", "extra", "error"), [
    ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
     ["custom_reward_function.name=compute_scor"], r"custom_reward_function.name='compute_scor' is not defined in "),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
     ["+custom_reward_function.reward_kwargs.scale=2"], r"does not take custom_reward_function.reward_kwargs \['scale'\]"),
    ("def compute_score(response, answer):\n    return 0.0\n", [],
     r"'compute_score' in .* cannot be called as reward_model.reward_manager='naive' calls it, with keywords "
     r"\['data_source', 'solution_str', 'ground_truth', 'extra_info'\]"),
    ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
     ["reward_model.reward_manager=batch"], r"reward_manager='batch' calls it, with keywords \['data_sources'"),
    ("import no_such_module\n", [], r"custom_reward_function.path=.* raised ModuleNotFoundError when it was imported"),
])
def test_a_custom_reward_function_that_cannot_be_called_is_refused_in_the_dry_run(files, tmp_path, source, extra,
                                                                                    error):
    """The function is loaded and its call checked before Ray (and by --dry-run, which passed all of these)."""
    custom = tmp_path / "reward.py"
    custom.write_text(source)
    with nothing_started(), pytest.raises(ValueError, match=error):
        validate_config(load_config([f"data.train_files={files['train']}", f"custom_reward_function.path={custom}",
                                     *extra]))


def test_data_source_without_scorer_and_unknown_agent_name_fail(files, tmp_path):
    base = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    unscored = write_rows(tmp_path / "unscored.parquet", ["gsm8k", "my_private_task"])
    with pytest.raises(ValueError, match=r"data.val_files .*no reward scorer for data_source \['my_private_task'\]"):
        validate_config(load_config(base + [f"data.train_files={files['train']}", f"data.val_files={unscored}"]))
    custom = tmp_path / "reward.py"
    custom.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    validate_config(load_config(base + [f"data.train_files={unscored}", f"custom_reward_function.path={custom}"]))
    agents = write_rows(tmp_path / "agents.parquet", ["gsm8k", "gsm8k"], agent_name=["tool_agent", "my_agent"])
    with pytest.raises(ValueError, match=r"agent_name \['my_agent'\] is not a registered agent loop"):
        validate_config(load_config(base + [f"data.train_files={agents}"]))


def test_help_lists_every_key_with_type_default_and_doc(capsys):
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    for item in describe_fields(PPO_TREE.root, derived=PPO_TREE.derived):
        assert f"  {item.key.rpartition('.')[2]}: {item.type_name} = {item.default!r}" in out, item.key
        assert item.doc, f"{item.key} has no doc line"
    assert "ppo_mini_batch_size: int = 256\n      Prompts per optimizer step" in out
    assert "ppo_mini_batch_size: int = '${actor_rollout_ref.actor.ppo_mini_batch_size}'" in out


def test_help_of_one_section(capsys):
    assert train_main(["--help", "actor_rollout_ref.actor.optim"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[actor_rollout_ref.actor.optim]") and "clip_grad: float" in out and "[data]" not in out
    assert train_main(["--help", "actor_rollout_ref.nope"]) == 2
    assert "no config section 'actor_rollout_ref.nope'" in capsys.readouterr().err


def test_sft_help_shows_verl_aliases(capsys):
    assert sft_main(["--help", "model"]) == 0
    assert "path: str = 'smollm2-135m-instruct' (also model.partial_pretrain)" in capsys.readouterr().out


def test_docs_config_reference_is_current():
    assert (REPO / "docs" / "config.md").read_text() == config_reference(), (
        "docs/config.md is stale: python -m hybridflow.trainer.config.help > docs/config.md"
    )


def test_every_field_of_both_trees_has_a_doc_line():
    for tree in (PPO_TREE, SFT_TREE):
        missing = [item.key for item in describe_fields(tree.root) if not item.doc]
        assert not missing, missing


def test_format_help_rejects_unknown_sections():
    with pytest.raises(ValueError, match="sections: "):
        format_help(PPO_TREE, "trainerx")


def test_frozen_sections_are_dataclasses_all_the_way_down(files):
    cfg = load_config([f"data.train_files={files['train']}"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor_rollout_ref.actor.clip_ratio = 0.3


PACKAGED_PPO_CONFIGS = sorted(
    path.stem for path in (Path(__file__).parents[2] / "hybridflow" / "trainer" / "config").glob("*.yaml")
    # the SFT, generation and evaluation trees' roots: tests/trainer/sft, test_generate.py, test_main_eval.py
    if path.stem not in ("sft_trainer", "sft_trainer_engine", "generation", "evaluation")
)


def test_the_packaged_configs_are_all_found():
    assert {"ppo_trainer", "grpo_smollm2_demo", "grpo_smollm2_moe_demo", "dapo_smollm2"} <= set(PACKAGED_PPO_CONFIGS)


@pytest.mark.parametrize("name", PACKAGED_PPO_CONFIGS)
def test_packaged_yaml_configs_compose_and_type(name):
    cfg = load_config([], config_name=name)
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length


def test_bypass_mode_takes_the_log_probs_of_any_backend_that_reports_them(files, caplog, monkeypatch):
    """verl runs bypass mode on vLLM, whose log-probs differ from the trainer's: hybridflow says so in a warning
    for such a backend (hf here) and refuses only one that reports none."""
    import dataclasses
    import logging

    from hybridflow.engines.rollout import registry

    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.bypass_mode=True"]
    with caplog.at_level(logging.WARNING):
        validate_config(load_config(line))
    assert "not the training engine's to float rounding" in caplog.text and "['native']" in caplog.text
    monkeypatch.setitem(registry._SPECS, "hf", dataclasses.replace(registry._SPECS["hf"], returns_log_probs=False))
    with pytest.raises(ValueError, match=r"rollout.name='hf' does not report them; use rollout.name in \['native'"):
        validate_config(load_config(line))


@pytest.mark.parametrize(
    ("extra", "source"),
    [
        ([], "update"),  # one epoch, one mini-batch: the update's forward gives the old log-probs
        (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], "recompute"),
        (["actor_rollout_ref.actor.ppo_epochs=2"], "recompute"),
        (["algorithm.use_kl_in_reward=True"], "recompute"),  # the reward penalty needs them before the update
        (["algorithm.rollout_correction.bypass_mode=True", "actor_rollout_ref.rollout.name=native"], "rollout"),
        # rollout correction needs the trainer's old log-probs on the driver before the update
        (["algorithm.rollout_correction.rollout_is=token"], "recompute"),
        (["algorithm.rollout_correction.rollout_rs=seq_mean_k1", "algorithm.rollout_correction.rollout_rs_threshold=1.5"],
         "recompute"),
    ],
)
def test_old_log_prob_source(files, extra, source):
    base = [f"data.train_files={files['train']}", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    cfg = load_config(base + extra)
    validate_config(cfg)
    assert cfg.old_log_prob_source == source


def test_rollout_correction_needs_an_engine_that_returns_rollout_log_probs(files, monkeypatch):
    from hybridflow.engines.rollout import ROLLOUTS, registry, rollout_spec
    from hybridflow.trainer.config.validate import _check_rollout_correction

    assert all(rollout_spec(name).returns_log_probs for name in ROLLOUTS.names()), "every built-in returns them"
    monkeypatch.setitem(ROLLOUTS._lazy, "my_engine", "hybridflow.engines.rollout.hf:HFRollout")  # a plug-in
    monkeypatch.setitem(registry._SPECS, "my_engine", registry.RolloutSpec())  # that declares nothing
    cfg = load_config([f"data.train_files={files['train']}", "algorithm.rollout_correction.rollout_is=token"])
    rollout = dataclasses.replace(cfg.actor_rollout_ref.rollout, name="my_engine")
    cfg = dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(cfg.actor_rollout_ref, rollout=rollout))
    with pytest.raises(ValueError, match=r"rollout_is='token'.*name='my_engine' does not return rollout_log_probs"):
        _check_rollout_correction(cfg)


def test_an_engine_of_another_library_is_refused_first_saying_what_to_use(files):
    with pytest.raises(ValueError, match=r"rollout.name='sglang' is unknown; known: \['hf', 'native', 'vllm'\] "
                                         r"\(SGLang is verl's other rollout engine.*use vllm"):
        load_config([f"data.train_files={files['train']}", "actor_rollout_ref.rollout.name=sglang",
                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])  # not a tensor-parallel complaint


def test_dynamic_batch_sizes_follow_the_actor_and_print_a_token_table(files, capsys):
    overrides = verl_lines(files)["actor_keys_only_gae"] + [
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",  # not used (and need not divide) with token budgets
    ]
    cfg = load_config(overrides)
    assert cfg.actor_rollout_ref.rollout.log_prob_token_budget == 4096 and cfg.critic.update_token_budget == 32768
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz and cfg.critic.forward_token_budget == 32768
    assert train_main(["--dry-run", *overrides]) == 0
    assert "micro-batches (use_dynamic_bsz): tokens each, at most about  4096" in capsys.readouterr().out


def test_disable_resume_on_a_directory_with_checkpoints_is_refused(files, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "global_step_3" / "actor").mkdir(parents=True)
    for kind in ("model", "optim", "extra_state"):  # what the resume reads (check_resume_contents)
        (run_dir / "global_step_3" / "actor" / f"{kind}_world_size_1_rank_0.pt").touch()
    overrides = [f"data.train_files={files['train']}", f"trainer.default_local_dir={run_dir}",
                 "algorithm.adv_estimator=grpo"]
    validate_config(load_config(overrides))  # auto resumes from it
    with pytest.raises(ValueError, match=r"resume_mode=disable starts a new run, .* already holds checkpoints \(steps \[3\]\)"):
        validate_config(load_config(overrides + ["trainer.resume_mode=disable"]))


def test_a_run_config_built_in_python_fills_its_own_run_directory(tmp_path, monkeypatch):
    """Without Hydra nothing resolves the default's `${trainer.project_name}`: the run's directory is filled from
    the section (it used to be a directory literally named `${trainer.project_name}`); a path with another
    interpolation left in it is refused; a composed config's directory is the same as the Python one's."""
    from hybridflow.trainer.config.schema import RunConfig

    monkeypatch.chdir(tmp_path)
    assert RunConfig().local_dir() == Path("checkpoints/hybridflow/run")
    assert RunConfig(project_name="p", experiment_name="e").local_dir() == Path("checkpoints/p/e")
    assert load_config(["trainer.project_name=p", "trainer.experiment_name=e"]).trainer.local_dir() == Path(
        "checkpoints/p/e")
    with pytest.raises(ValueError, match=r"default_local_dir='\$\{oc.env:NOPE\}/x' holds an interpolation"):
        RunConfig(default_local_dir="${oc.env:NOPE}/x").local_dir()


def test_resume_path_into_a_directory_with_checkpoints_only_from_its_latest(files, tmp_path):
    """Resuming another directory's checkpoint into one with checkpoints mixed two runs' saves (and pruning
    deleted the other run's); going back to an older step failed only at its first save, after Ray."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    for root, step in ((run_dir, 2), (run_dir, 4), (other, 6)):
        (root / f"global_step_{step}" / "actor").mkdir(parents=True)
        (root / f"global_step_{step}" / "driver_state.json").write_text("{}")
    base = [f"data.train_files={files['train']}", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=resume_path"]
    with nothing_started(), pytest.raises(ValueError, match=r"is a checkpoint of another directory, but "
                                                            r"trainer.default_local_dir=.* \(steps \[2, 4\]\)"):
        load_config([*base, f"trainer.resume_from_path={other / 'global_step_6'}"]).trainer.check_paths()
    with nothing_started(), pytest.raises(ValueError, match=r"goes back to step 2, but .* \[4\] after it: its next "
                                                            r"saves would collide"):
        load_config([*base, f"trainer.resume_from_path={run_dir / 'global_step_2'}"]).trainer.check_paths()
    load_config([*base, f"trainer.resume_from_path={run_dir / 'global_step_4'}"]).trainer.check_paths()
    fresh = [f"data.train_files={files['train']}", f"trainer.default_local_dir={tmp_path / 'new'}",
             "trainer.resume_mode=resume_path", f"trainer.resume_from_path={other / 'global_step_6'}"]
    load_config(fresh).trainer.check_paths()  # into an empty directory: a resumed run of its own


def test_a_resume_that_would_ignore_a_changed_lr_or_model_is_refused_before_ray(files, tmp_path):
    """The optimizer and scheduler state restore the saved lr, and the actor the saved weights: a changed lr was
    logged as the old one, and a changed model.path reached only the reference model, with no word."""
    run_dir = tmp_path / "run"
    actor = run_dir / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    for kind in ("model", "optim", "extra_state"):
        (actor / f"{kind}_world_size_1_rank_0.pt").touch()
    settings = {"actor_rollout_ref.model.path": files["model"], "actor_rollout_ref.actor.optim.lr": 1e-6}
    (run_dir / "global_step_3" / "driver_state.json").write_text(json.dumps({"global_steps": 3, "settings": settings}))
    base = [f"data.train_files={files['train']}", f"trainer.default_local_dir={run_dir}",
            f"actor_rollout_ref.model.path={files['model']}", "algorithm.adv_estimator=grpo"]
    validate_config(load_config(base))
    with nothing_started(), pytest.raises(ValueError, match=r"would ignore what the config changed "
                                                            r"\(actor_rollout_ref.actor.optim.lr: saved 1e-06, now 0.01\)"):
        validate_config(load_config([*base, "actor_rollout_ref.actor.optim.lr=1e-2"]))
    other = tmp_path / "other_model"
    shutil.copytree(files["model"], other)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.path: saved .*, now '.*other_model'"):
        validate_config(load_config([*base[:2], f"actor_rollout_ref.model.path={other}", base[3]]))
    validate_config(load_config([*base, "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp_path / 'new'}"]))


def test_a_resume_from_a_checkpoint_without_the_parts_it_reads_is_refused_before_ray(files, tmp_path):
    """save_contents=['hf_model'] keeps exports only: resuming from one would claim its step with the initial
    weights. A model-only checkpoint resumes when load_contents reads the model alone."""
    run_dir = tmp_path / "run"
    actor = run_dir / "global_step_2" / "actor"
    (actor / "huggingface_full").mkdir(parents=True)
    overrides = [f"data.train_files={files['train']}", f"trainer.default_local_dir={run_dir}",
                 "algorithm.adv_estimator=grpo"]
    with nothing_started(), pytest.raises(ValueError) as info:
        validate_config(load_config(overrides + ["actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"]))
    message = str(info.value)
    assert "holds no training state" in message and "missing ['model']" in message
    assert str(actor / "huggingface_full") in message and "resume_mode=disable" in message
    (actor / "model_world_size_1_rank_0.pt").touch()
    with pytest.raises(ValueError, match=r"missing \['optimizer', 'extra'\]"):
        validate_config(load_config(overrides))
    validate_config(load_config(overrides + ["actor_rollout_ref.actor.checkpoint.load_contents=[model]"]))


@pytest.mark.parametrize("key", ["default_local_dir", "resume_from_path"])
def test_a_url_for_the_checkpoint_directory_is_refused(files, key):
    """hdfs://... would otherwise become a local folder named 'hdfs:' under the working directory."""
    overrides = [f"data.train_files={files['train']}", f"trainer.{key}=hdfs://namenode/runs/x"]
    with pytest.raises(ValueError, match=rf"trainer.{key}='hdfs://namenode/runs/x' is a URL.*not supported"):
        validate_config(load_config(overrides))


def test_verls_config_flags_name_the_packaged_configs_or_say_what_to_do(files, tmp_path, capsys):
    """verl's scripts say `--config-path=config --config-name=ppo_trainer(.yaml)` for verl's own packaged configs;
    a user config that extends `ppo_trainer` (verl's `defaults: [ppo_trainer, _self_]`) finds the packaged one."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}"]
    assert train_main(["--dry-run", "--config-path=config", "--config-name=ppo_trainer.yaml", *line]) == 0
    user = tmp_path / "my_configs"
    user.mkdir()
    (user / "my_grpo.yaml").write_text("hydra:\n  searchpath:\n    - file://verl/trainer/config\ndefaults:\n"
                                       "  - ppo_trainer\n  - _self_\nalgorithm:\n  adv_estimator: grpo\n"
                                       "actor_rollout_ref:\n  rollout:\n    n: 4\n")
    capsys.readouterr()
    assert train_main(["--dry-run", f"--config-path={user}", "--config-name=my_grpo", *line]) == 0
    assert "adv_estimator: grpo" in capsys.readouterr().out
    assert train_main(["--dry-run", "--config-path=config", "--config-name=ppo_megatron_trainer", *line]) == 2
    assert "verl's Megatron-LM trainer config; hybridflow trains with FSDP2" in capsys.readouterr().err
    (user / "my_megatron.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    assert train_main(["--dry-run", f"--config-path={user}", "--config-name=my_megatron", *line]) == 2
    assert ("--config-name=my_megatron builds on ppo_megatron_trainer (its defaults list): verl's Megatron-LM "
            "trainer config") in capsys.readouterr().err
    assert train_main(["--dry-run", f"--config-path={user}", "--config-name=nope", *line]) == 2
    err = capsys.readouterr().err
    assert f"no nope.yaml in {user}" in err and "'ppo_trainer'" in err


def test_values_verl_documents_as_none_are_taken(files):
    cfg = load_config([f"data.train_files={files['train']}", "actor_rollout_ref.actor.optim.lr_warmup_steps=null",
                       "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.25", "custom_reward_function.name=null"])
    assert cfg.actor_rollout_ref.actor.optim.num_warmup_steps(40) == 10  # None delegates to the ratio
    with pytest.raises(ValueError, match=r"custom_reward_function.name=None with custom_reward_function.path=.*name the scoring function"):
        load_config([f"data.train_files={files['train']}", "custom_reward_function.name=null",
                     f"custom_reward_function.path={files['train']}"])


def test_a_context_raised_by_override_config_is_the_one_checked(files):
    """verl's DAPO lines raise the context (+actor_rollout_ref.model.override_config.max_position_embeddings)."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "data.max_prompt_length=2048", "data.max_response_length=20480"]
    with pytest.raises(ValueError, match=r"22528 exceeds the model's context of 4096 .*override_config.max_position_"):
        validate_config(load_config(line))
    raised = [*line, "+actor_rollout_ref.model.override_config.max_position_embeddings=32768"]
    with nothing_started():
        validate_config(load_config(raised))
        with pytest.raises(ValueError, match=r"override_config sets \['max_position_embeddings'\] and .*tensor_model_"):
            validate_config(load_config([*raised, "actor_rollout_ref.rollout.name=native",
                                         "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                         "trainer.n_gpus_per_node=2"]))


def test_verls_dapo_reward_kwargs_set_the_overlong_buffer(files):
    """verl's DAPO scripts pass the overlong buffer as `+reward_model.reward_kwargs.overlong_buffer_cfg.*` and
    `+reward_model.reward_kwargs.max_resp_len`; they land on reward_model.overlong_buffer."""
    from hybridflow.rewards.manager.dapo import DAPORewardManager

    line = [f"data.train_files={files['train']}", "reward_model.reward_manager=dapo", "data.max_response_length=512",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "+reward_model.reward_kwargs.max_resp_len=448"]
    cfg = load_config(line)
    buffer = cfg.reward_model.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.max_resp_len) == (True, 64, 0.5, 448)
    manager = DAPORewardManager.from_config(None, lambda *args, **kwargs: 0.0, cfg.reward_model, cfg.data)
    assert manager.max_resp_len == 448  # the penalty ramps up to verl's max_resp_len, not the rollout's 512
    with pytest.raises(ValueError, match=r"overlong_buffer.len=64 must be in 1..max_resp_len-1 = 1..47"):
        validate_config(load_config([*line, "+reward_model.reward_kwargs.max_resp_len=48"]))


def test_a_tools_file_that_fails_to_load_is_named_by_its_key(files, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.geo3k_tool.Geo3kTool\n    config: {}\n")
    line = [f"data.train_files={files['train']}", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.multi_turn.enable=True", "data.return_raw_chat=True",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"]
    with nothing_started():
        with pytest.raises(ValueError, match=r"^actor_rollout_ref.rollout.multi_turn.tool_config_path: .*tools\[0\]"
                                             r".class_name='verl.tools.geo3k_tool.Geo3kTool'"
                                             r".*name a registered tool"):
            validate_config(load_config(line))


def test_verl_keys_that_hold_or_are_refused_with_their_reason(files):
    """Keys from verl's example scripts: those whose effect hybridflow has anyway are taken, the others are refused
    naming why (not as unknown keys)."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}"]
    held = ["actor_rollout_ref.ref.strategy=fsdp2", "actor_rollout_ref.ref.use_torch_compile=False",
            "actor_rollout_ref.actor.entropy_checkpointing=True", "actor_rollout_ref.rollout.layered_summon=True",
            "reward_model.use_reward_loop=True", "trainer.use_legacy_worker_impl=disable",
            "actor_rollout_ref.model.use_shm=False", "actor_rollout_ref.model.use_liger=False",
            "data.filter_overlong_prompts_workers=64", "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
            "actor_rollout_ref.ref.entropy_checkpointing=True", "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
            "actor_rollout_ref.actor.fsdp_config.strategy=fsdp", "actor_rollout_ref.actor.fsdp_config.use_orig_params=True",
            "actor_rollout_ref.rollout.skip_tokenizer_init=True", "reward_model.reward_manager=prime",
            "actor_rollout_ref.model.use_shm=True", "data.trust_remote_code=True", "actor_rollout_ref.nccl_timeout=1800",
            "actor_rollout_ref.rollout.over_sample_rate=0.1"]
    held += ["actor_rollout_ref.actor.calculate_sum_pi_squared=True",
             "actor_rollout_ref.actor.sum_pi_squared_checkpointing=True"]
    cfg = load_config([*line, *held])
    assert cfg.actor_rollout_ref.actor.entropy_checkpointing and cfg.reward_model.use_reward_loop
    refused = {
        "actor_rollout_ref.ref.use_torch_compile=True": "runs eagerly",
        "actor_rollout_ref.model.use_liger=True": "Liger kernels are not used",
        "actor_rollout_ref.actor.sum_pi_squared_checkpointing=True": "nothing computes sum",
        "reward_model.sandbox_fusion.url=sandbox:8080": "must be an http",
        "actor_rollout_ref.rollout.data_parallel_size=2": "replicas are data-parallel already",
        "actor_rollout_ref.actor.fsdp_config.full_determinism=True": "deterministic kernels",
    }
    for override, reason in refused.items():
        with pytest.raises(ValueError, match=reason):
            load_config([*line, override])
    with pytest.raises(ValueError, match=r"ref.entropy_from_logits_with_chunking=True with actor_rollout_ref.model."
                                         r"use_fused_kernels=False"):
        load_config([*line, "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
                     "actor_rollout_ref.model.use_fused_kernels=False"])
    with pytest.raises(ValueError, match=r"entropy_checkpointing=True with actor_rollout_ref.model.use_fused_kernels"):
        load_config([*line, "actor_rollout_ref.actor.entropy_checkpointing=True",
                     "actor_rollout_ref.model.use_fused_kernels=False"])
    loop = load_config([*line, "reward_model.use_reward_loop=True", "reward_model.enable=True",
                        f"reward_model.model.path={files['model']}"]).reward_model
    assert loop.serves_in_reward_loop and loop.layout_keys[0] == "reward_model.rollout.tensor_model_parallel_size"


def test_step_counts_written_as_booleans_count_as_verl_counts_them(files):
    """verl's e2e scripts write `trainer.test_freq=False`; verl compares it as a number (off)."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}"]
    trainer = load_config([*line, "trainer.test_freq=False", "trainer.save_freq=True"]).trainer
    assert (trainer.test_freq, trainer.save_freq) == (0, 1)
    with pytest.raises(ValueError, match=r"trainer.total_epochs=False must be int"):
        load_config([*line, "trainer.total_epochs=False"])


def test_a_key_verl_adds_with_plus_is_an_override_where_hybridflow_has_it(files):
    """verl's scripts add keys verl lacks with `+`; where hybridflow has the key, Hydra's `+` would refuse to add it
    again, so it overrides instead. A key neither has is still unknown."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}"]
    cfg = load_config([*line, "+actor_rollout_ref.actor.fsdp_config.model_dtype=float32"])
    assert cfg.actor_rollout_ref.actor.fsdp_config.model_dtype == "float32"
    with pytest.raises(ValueError, match=r"fsdp_config.model_dtype='fp16' is not one of"):  # checked, not added
        load_config([*line, "+actor_rollout_ref.actor.fsdp_config.model_dtype=fp16"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.no_such_key"):
        load_config([*line, "+actor_rollout_ref.actor.no_such_key=1"])


def test_data_trust_remote_code_reaches_the_drivers_tokenizer_and_processor(files, monkeypatch):
    """verl's data.trust_remote_code is the trust given to the tokenizer and processor that prepare the prompts."""
    from hybridflow.trainer import scaffold

    seen = []
    monkeypatch.setattr(scaffold, "load_tokenizer", lambda path, trust_remote_code=False: seen.append(trust_remote_code))
    cfg = load_config([f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
                       "data.trust_remote_code=True"])
    scaffold.build_tokenizer(cfg.actor_rollout_ref.model, cfg.data.trust_remote_code)
    scaffold.build_tokenizer(cfg.actor_rollout_ref.model)
    assert seen == [True, False]


def test_verl_s_old_global_micro_batch_keys_become_per_gpu_ones(files):
    """`ppo_micro_batch_size` and the other global forms are divided over the role's data-parallel ranks, as verl's
    workers divide them; the keys derived from a per-GPU one follow it."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "trainer.n_gpus_per_node=4"]
    cfg = load_config([*line, "actor_rollout_ref.actor.ppo_micro_batch_size=16",
                       "actor_rollout_ref.ref.log_prob_micro_batch_size=8", "critic.forward_micro_batch_size=12",
                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    arr = cfg.actor_rollout_ref
    assert arr.actor.ppo_micro_batch_size_per_gpu == 8  # 16 over 4 ranks / sp 2
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == 8, "derived from the actor's per-GPU size"
    assert arr.ref.log_prob_micro_batch_size_per_gpu == 4  # the reference's sp follows the actor's
    assert (cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.forward_micro_batch_size_per_gpu) == (8, 3)
    assert arr.actor.ppo_micro_batch_size is None, "applied, not kept beside the per-GPU size"
    rm = load_config([*line, "reward_model.micro_batch_size=8", "reward_model.enable_resource_pool=True",
                      "reward_model.enable=True", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=2"])
    assert rm.reward_model.micro_batch_size_per_gpu == 4, "the reward model's own pool of 2"
    with pytest.raises(ValueError, match=r"ppo_micro_batch_size=16 and actor_rollout_ref.actor.ppo_micro_batch_size"
                                         r"_per_gpu=2 are both given"):
        load_config([*line, "actor_rollout_ref.actor.ppo_micro_batch_size=16",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    with pytest.raises(ValueError, match=r"log_prob_micro_batch_size=2 over 4 data-parallel ranks leaves less than one"):
        load_config([*line, "actor_rollout_ref.rollout.log_prob_micro_batch_size=2"])


def test_entries_of_free_form_dicts_are_set_with_or_without_plus(files):
    """verl's scripts set `rollout.engine_kwargs.sglang.attention_backend=triton` (no `+`) and
    `+model.override_config.x=...`; both land in the dict, and an engine's entry this run does not read is refused."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}"]
    cfg = load_config([*line, "actor_rollout_ref.model.override_config.attn_implementation=eager",
                       "+critic.model.override_config.attn_implementation=sdpa"])
    assert cfg.actor_rollout_ref.model.override_config == {"attn_implementation": "eager"}
    assert cfg.critic.model.override_config == {"attn_implementation": "sdpa"}
    vllm = load_config([*line, "actor_rollout_ref.rollout.name=vllm",
                        "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"]).actor_rollout_ref.rollout
    assert vllm.engine_kwargs == {"vllm": {"swap_space": 4}}
    with pytest.raises(ValueError, match=r"engine_kwargs.sglang=\{'attention_backend': 'triton'\} sets the sglang "
                                         r"engine, but actor_rollout_ref.rollout.name='hf' does not read them"):
        load_config([*line, "actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton"])


def test_tools_interactions_and_agent_rows_run_in_agent_loops_or_are_refused(files, tmp_path):
    """verl's default mode is async: a tool or interaction config alone (verl's multi-turn lines without their
    --config-name) makes agent loops the default; with batch generation they, and rows naming an agent loop, would
    be ignored, so they are refused."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calculator\n")
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "data.return_raw_chat=True"]
    for key in ("tool_config_path", "interaction_config_path"):
        path = tools if key == "tool_config_path" else tmp_path / "interactions.yaml"
        path.write_text(path.read_text() if path.exists() else "interaction:\n  - name: answer_feedback\n")
        override = f"actor_rollout_ref.rollout.multi_turn.{key}={path}"
        assert load_config([*line, override]).actor_rollout_ref.rollout.mode == "async"
        with pytest.raises(ValueError, match=rf"multi_turn.{key}=.* with actor_rollout_ref.rollout.mode=sync: tools and "
                                             r"interactions run only in agent loops"):
            validate_config(load_config([*line, override, "actor_rollout_ref.rollout.mode=sync"]))
    assert load_config(line).actor_rollout_ref.rollout.mode == "sync"
    agent_rows = write_rows(tmp_path / "agents.parquet", ["gsm8k"] * 1024, agent_name=["tool_agent"] * 1024)
    with pytest.raises(ValueError, match=r"rows ask for agent loop \['tool_agent'\] \(column agent_name\), which runs "
                                         r"only with actor_rollout_ref.rollout.mode=async"):
        validate_config(load_config([*line[1:], f"data.train_files={agent_rows}"]))
    single = write_rows(tmp_path / "single.parquet", ["gsm8k"] * 1024, agent_name=["single_turn_agent"] * 1024)
    validate_config(load_config([*line[1:], f"data.train_files={single}"]))


def test_an_interaction_config_needs_rows_that_name_their_interaction(files, tmp_path):
    """verl's tool agent requires extra_info.interaction_kwargs.name when interactions are configured; a row without
    it would run as a plain single turn, so it is refused before Ray (verl's interaction doc line on plain data)."""
    config = tmp_path / "interactions.yaml"
    config.write_text("interaction:\n  - name: answer_feedback\n")
    line = [f"actor_rollout_ref.model.path={files['model']}", "data.return_raw_chat=True",
            "actor_rollout_ref.rollout.multi_turn.enable=True", f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={config}"]
    with pytest.raises(ValueError, match=r"train.parquet' row 0: .*interaction_kwargs names no interaction"):
        validate_config(load_config([*line, f"data.train_files={files['train']}"]))
    named = write_rows(tmp_path / "named.parquet", ["gsm8k"] * 1024,
                       extra_info=[{"interaction_kwargs": {"name": "answer_feedback", "ground_truth": "4"}}] * 1024)
    validate_config(load_config([*line, f"data.train_files={named}"]))


def test_a_registered_reward_manager_without_from_config_is_refused_before_ray(files, monkeypatch):
    from hybridflow.rewards.manager_registry import REWARD_MANAGERS

    class Plain:
        def __call__(self, data):
            return data

    monkeypatch.setitem(REWARD_MANAGERS._entries, "plain_for_test", Plain)
    with nothing_started(), pytest.raises(ValueError, match=r"reward_model.reward_manager='plain_for_test' names .* "
                                                            r"which has no from_config\(tokenizer, compute_score"):
        validate_config(load_config([f"data.train_files={files['train']}", "reward_model.reward_manager=plain_for_test"]))


def test_a_resume_whose_shards_were_cut_for_other_ranks_is_refused_before_ray(files, tmp_path):
    """The actor's layout.json records the ranks its shards were cut for; another n_gpus_per_node or fsdp_size
    failed in the workers, after Ray started and the models loaded."""
    run_dir = tmp_path / "run"
    actor = run_dir / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    for kind in ("model", "optim", "extra_state"):
        (actor / f"{kind}_world_size_2_rank_0.pt").touch()
    (run_dir / "global_step_3" / "driver_state.json").write_text(json.dumps({"global_steps": 3}))
    layout = {"tensor_parallel_size": 1, "ulysses_sequence_parallel_size": 1, "expert_parallel_size": 1,
              "fsdp_size": 2, "world_size": 2}
    (actor / "layout.json").write_text(json.dumps(layout))
    base = [f"data.train_files={files['train']}", f"trainer.default_local_dir={run_dir}",
            f"actor_rollout_ref.model.path={files['model']}", "algorithm.adv_estimator=grpo"]
    validate_config(load_config([*base, "trainer.n_gpus_per_node=2"]))
    with nothing_started(), pytest.raises(ValueError, match=r"resumes from .*global_step_3, whose actor was written "
                                                            r"with world_size=2, this run uses 4: resume with the same "
                                                            r"layout .*or export it \(hybridflow merge\)"):
        validate_config(load_config([*base, "trainer.n_gpus_per_node=4"]))
    (actor / "layout.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"layout.json cannot be read .*the checkpoint is damaged"):
        validate_config(load_config([*base, "trainer.n_gpus_per_node=2"]))
