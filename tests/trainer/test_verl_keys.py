"""The keys of verl's newest PPO config that hybridflow did not know: each loads at verl's default, works where it
is built (custom_chat_template, validation_shuffle, timeline_json_file, calculate_entropy, turn limits of None),
and is otherwise refused naming why; verl's copies of other keys must agree with what they copy."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.models import load_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.config.verl_copies import check_verl_copies
from hybridflow.trainer.scaffold import write_ray_timeline
from hybridflow.trainer.scaffold import build_tokenizer, build_val_loader
from hybridflow.workers.config import ActorConfig
from hybridflow.workers.ppo_update import update_computes_entropy
from tests.trainer.test_config_tree import files  # noqa: F401  (fixture)

VERL_DEFAULTS = [  # verl's _generated_ppo_trainer.yaml values, as a line would write them
    "actor_rollout_ref.actor.calculate_entropy=False", "actor_rollout_ref.actor.checkpoint.async_save=False",
    "actor_rollout_ref.actor.data_loader_seed=42", "actor_rollout_ref.actor.fsdp_config.seed=42",
    "actor_rollout_ref.actor.fsdp_config.forward_only=False", "actor_rollout_ref.ref.fsdp_config.forward_only=True",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=False",
    "actor_rollout_ref.model.custom_chat_template=null", "actor_rollout_ref.model.enable_activation_offload=False",
    "actor_rollout_ref.model.hf_config_path=null", "actor_rollout_ref.model.mtp.enable=False",
    "actor_rollout_ref.model.mtp.speculative_algorithm=EAGLE", "actor_rollout_ref.model.tiled_mlp.enabled=False",
    "actor_rollout_ref.model.tiled_mlp.num_shards=4", "actor_rollout_ref.ref.router_replay.mode=disabled",
    "actor_rollout_ref.rollout.agent.num_workers=8", "actor_rollout_ref.rollout.agent.agent_loop_config_path=null",
    "actor_rollout_ref.rollout.agent.custom_async_server.name=null", "actor_rollout_ref.rollout.ignore_eos=False",
    "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs", "actor_rollout_ref.rollout.disable_log_stats=True",
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=strict",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=null", "actor_rollout_ref.rollout.multi_turn.max_user_turns=null",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size=1", "actor_rollout_ref.rollout.prometheus.enable=False",
    "actor_rollout_ref.rollout.prometheus.port=9090", "actor_rollout_ref.rollout.quantization=null",
    "actor_rollout_ref.rollout.scheduling_policy=fcfs", "actor_rollout_ref.rollout.skip_rollout=False",
    "actor_rollout_ref.rollout.trace.backend=null", "actor_rollout_ref.rollout.trace.token2text=False",
    "critic.checkpoint.async_save=False", "critic.data_loader_seed=42", "critic.model.tiled_mlp.enabled=False",
    "data.datagen.path=null", "data.image_patch_size=14", "data.return_full_prompt=False",
    "data.return_multi_modal_inputs=True", "data.return_raw_input_ids=False", "data.sampler.class_path=null",
    "data.use_shm=False", "data.validation_shuffle=False", "ray_kwargs.timeline_json_file=null",
    "reward_manager.source=register", "reward_manager.module.path=null", "reward_model.reward_loop_source=register",
    "reward_model.reward_loop_module_path=null", "trainer.default_hdfs_dir=null", "trainer.del_local_ckpt_after_load=False",
    "trainer.esi_redundant_time=0", "trainer.ray_wait_register_center_timeout=300", "transfer_queue.enable=False",
]

REFUSED = [  # (override, words of the reason)
    ("actor_rollout_ref.rollout.ignore_eos=True", "ends at the tokenizer's eos"),
    ("actor_rollout_ref.model.tiled_mlp.enabled=True", "enable_gradient_checkpointing"),
    ("actor_rollout_ref.model.mtp.enable=True", "multi-token prediction"),
    ("actor_rollout_ref.rollout.quantization=fp8", "rollout.dtype"),
    ("actor_rollout_ref.rollout.logprobs_mode=raw_logprobs", "logprobs_mode"),
    ("actor_rollout_ref.rollout.trace.backend=mlflow", "rollout_data_dir"),
    ("actor_rollout_ref.rollout.prometheus.enable=True", "trainer.logger"),
    ("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2", "actor.ulysses_sequence_parallel_size"),
    ("actor_rollout_ref.actor.checkpoint.async_save=True", "renamed atomically"),
    ("trainer.del_local_ckpt_after_load=True", "never deleted"),
    ("trainer.default_hdfs_dir=/hdfs/x", "not copied to HDFS"),
    ("transfer_queue.enable=True", "object store"),
    ("data.sampler.class_path=my_sampler.py", "set both"),  # verl's class_name is needed with it
    ("reward_manager.source=importlib", "reward_manager.source"),
    ("actor_rollout_ref.rollout.disable_log_stats=False", "sets the vllm engine, but .*name=.* does not read it"),
    ("actor_rollout_ref.model.fused_kernel_options.impl_backend=triton", "triton kernels are not built"),
    # training-only settings on the frozen reference (its passes save nothing for a backward)
    ("actor_rollout_ref.ref.model.enable_activation_offload=True", "the reference is frozen"),
    ("actor_rollout_ref.ref.model.enable_gradient_checkpointing=True", "the reference is frozen"),
    ("actor_rollout_ref.ref.model.custom_chat_template='{{ x }}'", "the reference scores the policy's token ids"),
    ("actor_rollout_ref.ref.model.use_shm=True", "only the actor's model is copied to /dev/shm"),
    # settings read only by a feature that is refused: inert, so refused too
    ("actor_rollout_ref.model.tiled_mlp.num_shards=8", "read only with tiled_mlp.enabled=True"),
    ("actor_rollout_ref.model.mtp.num_speculative_tokens=3", "read only with mtp.enable_rollout=True"),
    ("actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.2", "read only with mtp.enable_train=True"),
    ("actor_rollout_ref.rollout.prometheus.port=9091", "read only with prometheus.enable=True"),
    ("actor_rollout_ref.rollout.trace.token2text=True", "read only with a trace.backend"),
    ("global_profiler.global_tool_config.torch_memory.stack_depth=64", "records whole stacks"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch_memory.stack_depth=8", "records whole stacks"),
]


def test_verl_s_defaults_load_as_written():
    cfg = load_config(VERL_DEFAULTS)
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns is None
    assert cfg.actor_rollout_ref.actor.rollout_n == cfg.actor_rollout_ref.rollout.n  # derived as in verl
    assert cfg.reward_manager.name == cfg.reward_model.reward_manager


@pytest.mark.parametrize(("override", "reason"), REFUSED)
def test_what_is_not_built_is_refused_naming_why(override, reason):
    with pytest.raises(ValueError, match=reason):
        load_config([override])


@pytest.mark.parametrize(("override", "message"), [
    ("actor_rollout_ref.actor.rollout_n=3", r"rollout_n=3 differs from actor_rollout_ref.rollout.n=1"),
    ("critic.rollout_n=2", r"critic.rollout_n=2 differs"),
    ("actor_rollout_ref.actor.use_remove_padding=True", r"set actor_rollout_ref.model.use_remove_padding"),
    ("reward_manager.name=dapo", r"reward_manager.name='dapo' differs from reward_model.reward_manager='naive'"),
    ("data.tool_config_path=tools.yaml", r"multi_turn.tool_config_path"),
    ("actor_rollout_ref.actor.fsdp_config.forward_only=True", r"forward_only=True: that role trains"),
    ("actor_rollout_ref.ref.fsdp_config.forward_only=False", r"forward_only=False: that role only runs forwards"),
    ("actor_rollout_ref.ref.router_replay.mode=R3", r"the reference replays the rollout's experts exactly when"),
])
def test_verl_s_copies_must_agree_with_what_they_copy(override, message):
    check_verl_copies(load_config(["actor_rollout_ref.actor.rollout_n=1", "reward_manager.name=naive"]))
    with pytest.raises(ValueError, match=message):
        check_verl_copies(load_config([override]))


def test_the_copies_are_checked_before_ray(files):  # noqa: F811
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "algorithm.adv_estimator=grpo"]
    with pytest.raises(ValueError, match="rollout_n=3 differs"):
        validate_config(load_config([*line, "actor_rollout_ref.actor.rollout_n=3"]))


def test_a_custom_chat_template_renders_the_prompts(tmp_path):
    template = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
    tokenizer = build_tokenizer(ModelConfig(custom_chat_template=template))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<<user>>hi"
    plain = build_tokenizer(ModelConfig())
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) != text


def test_validation_shuffle_keeps_every_prompt_once():
    rows = list(range(23))
    ordered = [int(x) for batch in build_val_loader(rows, 5, torch.tensor) for x in batch]
    shuffled = [int(x) for batch in build_val_loader(rows, 5, torch.tensor, shuffle_seed=3) for x in batch]
    again = [int(x) for batch in build_val_loader(rows, 5, torch.tensor, shuffle_seed=3) for x in batch]
    assert ordered == rows and sorted(shuffled) == rows and shuffled != rows and shuffled == again


def test_ray_s_timeline_is_never_written_over_a_file(files, tmp_path, caplog):  # noqa: F811
    existing = tmp_path / "timeline.json"
    existing.write_text("{}")
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "algorithm.adv_estimator=grpo"]
    with pytest.raises(ValueError, match="timeline_json_file=.* exists"):
        validate_config(load_config([*line, f"ray_kwargs.timeline_json_file={existing}"]))
    import ray

    if not ray.is_initialized():  # local mode: no cluster, nothing to write
        with caplog.at_level(logging.WARNING):
            write_ray_timeline(str(tmp_path / "local.json"))
        assert "no Ray cluster ran" in caplog.text and not (tmp_path / "local.json").exists()


@pytest.mark.slow  # starts a Ray cluster of its own
def test_ray_s_timeline_is_written_at_the_end(tmp_path):
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False)
    try:
        write_ray_timeline(str(tmp_path / "not_yet" / "new.json"))  # its folder is made (a run's output folder)
    finally:
        if started:
            ray.shutdown()
    assert (tmp_path / "not_yet" / "new.json").read_text().startswith("[")


def test_calculate_entropy_makes_the_update_compute_it():
    assert not update_computes_entropy(ActorConfig(entropy_coeff=0.0), False)
    assert update_computes_entropy(ActorConfig(entropy_coeff=0.0, calculate_entropy=True), False)
    assert update_computes_entropy(ActorConfig(entropy_coeff=0.01), False)
    assert update_computes_entropy(ActorConfig(entropy_coeff=0.0), True)


def test_multi_turn_defaults_to_agent_loops_as_verl_s_async_mode(files):  # noqa: F811
    """verl's rollout.mode defaults to async; here the default follows multi_turn.enable (only agent loops run the
    tool agent), and a mode given on the command line wins: multi-turn with mode=sync is refused before Ray."""
    line = [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "data.return_raw_chat=True"]
    assert load_config(line).actor_rollout_ref.rollout.mode == "sync"
    multi_turn = [*line, "actor_rollout_ref.rollout.multi_turn.enable=True"]
    assert load_config(multi_turn).actor_rollout_ref.rollout.mode == "async"
    with pytest.raises(ValueError, match="multi_turn.enable=True needs actor_rollout_ref.rollout.mode=async"):
        validate_config(load_config([*multi_turn, "actor_rollout_ref.rollout.mode=sync"]))
