"""Bad input fails fast, before Ray or weights, with a message naming the key (or file/row) and the fix."""

from __future__ import annotations


import pytest

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.main_ppo import main as train_main
from tests.helpers import grpo_overrides, nothing_started, write_rows



@pytest.fixture()
def train_file(tmp_path):
    return write_rows(tmp_path / "train.parquet", ["gsm8k", "reasoning_gym/basic_arithmetic"] * 8)


def check(overrides: list[str]) -> None:
    validate_config(load_config(overrides))


def test_the_good_config_passes_and_derives_batch_numbers(train_file):
    sizes = validate_config(load_config(grpo_overrides(train_file)))
    actor = sizes["actor"]
    assert (actor.samples_per_step, actor.mini_batch_samples, actor.mini_batch_samples_per_rank) == (32, 16, 8)
    assert (actor.grad_accum_steps, actor.optimizer_steps_per_step) == (4, 2)
    assert "critic" not in sizes  # grpo trains no critic


CASES = [
    # (override, words the message must contain)
    ("trainer.bogus_key=1", ["bogus_key", "unknown key"]),
    ("data.prompt_key=question", ["train.parquet' has no 'question' column (data.prompt_key)", "'prompt'"]),
    ("data.train_batch_size=abc", ["data.train_batch_size", "abc"]),
    ("data.train_batch_size=0", ["data.train_batch_size", "> 0"]),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=3", ["data.train_batch_size=8", "ppo_mini_batch_size=3", "divisor"]),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16", ["ppo_mini_batch_size=16", "larger than data.train_batch_size"]),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", ["ppo_micro_batch_size_per_gpu=3", "8 mini-batch samples"]),
    ("trainer.n_gpus_per_node=3", ["cannot be split over 3 ranks", "multiple of 3"]),
    ("algorithm.adv_estimator=grpoo", ["algorithm.adv_estimator='grpoo'", "grpo", "rloo"]),
    ("algorithm.adv_estimator=optimal_token_baseline", ["optimal_token_baseline", "calculate_sum_pi_squared=True"]),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=ppo2", ["policy_loss.loss_mode='ppo2'", "vanilla"]),
    ("actor_rollout_ref.actor.loss_agg_mode=mean", ["loss_agg_mode='mean'", "token-mean"]),
    ("actor_rollout_ref.actor.kl_loss_type=k9", ["kl_loss_type='k9'", "low_var_kl"]),
    ("actor_rollout_ref.rollout.name=sglang", ["rollout.name='sglang'", "hf"]),
    ("reward_model.reward_manager=fancy", ["reward_manager='fancy'", "naive"]),
    ("data.train_files=[/nonexistent/train.parquet]", ["data.train_files", "/nonexistent/train.parquet", "does not exist"]),
    ("data.val_files=[/nonexistent/val.parquet]", ["data.val_files", "does not exist"]),
    ("custom_reward_function.path=/nonexistent/reward.py", ["custom_reward_function.path", "does not exist"]),
    ("trainer.logger=[console,printer]", ["trainer.logger", "printer", "tensorboard"]),
    ("trainer.resume_mode=resume_path", ["resume_from_path"]),
    ("trainer.resume_mode=sometimes", ["trainer.resume_mode='sometimes'", "auto"]),
    ("actor_rollout_ref.rollout.top_p=0", ["rollout.top_p", "(0.0, 1.0]"]),
    ("algorithm.kl_ctrl.type=pid", ["algorithm.kl_ctrl.type='pid'", "adaptive"]),
    ("data.truncation=sideways", ["data.truncation='sideways'", "left"]),
    ("actor_rollout_ref.model.path=/nonexistent/model", ["actor_rollout_ref.model.path", "/nonexistent/model"]),
    ("trainer.local_mode=True", ["trainer.local_mode", "n_gpus_per_node=1"]),
    ("critic.enable=False algorithm.adv_estimator=gae", ["gae", "critic.enable=False"]),
    ("trainer.val_only=True data.val_files=[]", ["trainer.val_only", "data.val_files"]),
    ("actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_adapter_path=/nonexistent",
     ["model.lora_adapter_path", "adapter_config.json"]),
    ("actor_rollout_ref.model.lora_adapter_path=/nonexistent", ["model.lora_adapter_path", "adapter_config.json"]),
    ("actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=0", ["multi_turn.max_tokens_per_turn", "> 0"]),
    ("actor_rollout_ref.rollout.agent.max_concurrent_loops=0", ["agent.max_concurrent_loops", "> 0"]),
    ("trainer.rpc_timeout_s=0", ["trainer.rpc_timeout_s", "> 0"]),
    ("trainer.heartbeat_timeout_s=-1", ["trainer.heartbeat_timeout_s", "> 0"]),
    ("actor_rollout_ref.actor.optim.optimizer=AdamWW", ["actor.optim.optimizer='AdamWW'", "'AdamW'"]),
    ("+actor_rollout_ref.actor.optim.override_optimizer_config.fusd=True",
     ["actor.optim.override_optimizer_config has ['fusd']", "'fused'"]),
    ("algorithm.adv_estimator=gae critic.optim.optimizer_impl=no_such_optim_package",
     ["critic.optim.optimizer_impl='no_such_optim_package' cannot be imported"]),
]


@pytest.mark.parametrize(("override", "words"), CASES, ids=[case[0] for case in CASES])
def test_bad_value_is_named_in_the_error(train_file, override, words):
    overrides = grpo_overrides(train_file) + override.split(" ")
    with nothing_started(), pytest.raises(ValueError) as info:
        check(overrides)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_missing_train_files_names_the_key():
    with pytest.raises(ValueError, match=r"data.train_files is empty"):
        check(["algorithm.adv_estimator=gae"])


def test_context_overflow_names_both_lengths(tmp_path, train_file):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"max_position_embeddings": 64}')
    (model_dir / "model.safetensors").write_bytes(b"")
    overrides = grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={model_dir}"]
    with pytest.raises(ValueError, match=r"max_prompt_length \+ data.max_response_length = 96 exceeds .* 64"):
        check(overrides)


def test_cli_prints_one_line_and_exits_2(train_file, capsys):
    code = train_main(grpo_overrides(train_file) + ["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hybridflow train: config error:") and "rollout.n >= 2" in err


def test_dry_run_prints_config_and_batch_table_without_ray(train_file, capsys, monkeypatch):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("--dry-run must not start Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    assert train_main(["--dry-run", *grpo_overrides(train_file)]) == 0
    out = capsys.readouterr().out
    assert "adv_estimator: grpo" in out and "gradient accumulation steps" in out and "[actor]" in out


def test_cfg_job_prints_composed_config(train_file, capsys):
    assert train_main(["--cfg", "job", *grpo_overrides(train_file)]) == 0
    assert "ppo_mini_batch_size: 4" in capsys.readouterr().out


# Errors between sections that the checks find before any model, device or backend is read.
CROSS_SECTION_ERRORS = [
    ("algorithm.adv_estimator=tir_optimal_token_baseline", "calculate_sum_pi_squared=True"),
    ("algorithm.adv_estimator=nope", "algorithm.adv_estimator='nope' is unknown"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=nope", "policy_loss.loss_mode='nope' is unknown"),
    ("reward_model.reward_manager=nope", "reward_model.reward_manager='nope' is unknown"),
    ("actor_rollout_ref.rollout.name=nope", "actor_rollout_ref.rollout.name='nope' is unknown"),
    ("trainer.critic_warmup=1", "trainer.critic_warmup=1 needs a critic"),
    ("data.train_batch_size=64", "larger than the 16 training rows"),
    ("actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=50",
     "below the longest sequence"),
    ("trainer.n_gpus_per_node=3", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.hybrid_engine=True rollout.n_gpus_per_node=4", "rollout.n_gpus_per_node=4"),
]


def test_cross_section_errors_print_before_torch_transformers_or_ray_load(train_file):
    """What makes a config error slow is importing the runtime (torch alone takes seconds on a 2-core host): in a
    fresh interpreter each of these errors exits 2 with its message, and none of them has loaded torch,
    transformers or Ray."""
    import json
    import subprocess
    import sys

    cases = [grpo_overrides(train_file) + override.split() for override, _ in CROSS_SECTION_ERRORS]
    code = (
        "import contextlib, io, json, sys\n"
        "from hybridflow.trainer.main_ppo import main\n"
        "results = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        results.append((main(args), err.getvalue()))\n"
        "loaded = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
        "print(json.dumps({'results': results, 'loaded': loaded}))\n"
    )
    completed = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    for (override, words), (exit_code, message) in zip(CROSS_SECTION_ERRORS, report["results"], strict=True):
        assert exit_code == 2 and "config error" in message and words in message, (override, message)
    assert report["loaded"] == [], f"a config error loaded {report['loaded']}"


def test_the_native_rollout_refuses_a_moe_it_cannot_run_before_ray_and_hf_takes_it(tmp_path, train_file):
    """A family whose attention the native engine lacks (a tiny DeepSeek-V3 checkpoint whose config.json names
    DeepSeek-V2) is refused before Ray starts; the hf rollout takes it."""
    import json
    from pathlib import Path

    from hybridflow.models.moe import save_tiny_moe_model

    model_dir = save_tiny_moe_model(tmp_path / "v2", "deepseek_v3")
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_type": "deepseek_v2"}))
    overrides = grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={model_dir}"]
    with nothing_started(), pytest.raises(ValueError, match=r"rollout.name='native' cannot run .*model type "
                                                            r"'deepseek_v2' is a mixture-of-experts model.*rollout.name=hf"):
        check(overrides + ["actor_rollout_ref.rollout.name=native"])


def test_the_native_rollout_takes_mixtral_qwen2_moe_qwen3_moe_and_deepseek_v3(tmp_path, train_file):
    from hybridflow.models.moe import save_tiny_moe_model

    for arch in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        model_dir = save_tiny_moe_model(tmp_path / arch, arch)
        check(grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=native"])


def test_tensor_and_sequence_parallel_sizes_are_checked_against_the_model_shape(tmp_path, train_file):
    """The layout checks that read the model's config (heads, key/value heads) run before Ray: sizes that fit pass,
    one that splits the key/value heads is refused naming the count and the sizes that would fit."""
    from hybridflow.models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny")  # 4 heads, 2 key/value heads
    base = grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={model_dir}"]
    with nothing_started():
        check(base + ["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2"])
        check(base + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                      "actor_rollout_ref.model.use_remove_padding=True"])
        with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's "
                                             r"num_key_value_heads=2.*\(2\)"):
            check(base + ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=4"])


def test_expert_parallel_sizes_are_checked_against_the_model_and_the_ranks(tmp_path, train_file):
    """Expert parallelism before Ray: a size that divides the experts and the ranks passes (the reference follows
    the actor's); a dense model, a size that splits the experts unevenly, one that does not divide the ranks and
    one combined with LoRA are refused naming the key."""
    from hybridflow.models import save_tiny_model
    from hybridflow.models.moe import save_tiny_moe_model

    moe = [f"actor_rollout_ref.model.path={save_tiny_moe_model(tmp_path / 'moe', 'qwen3_moe')}"]  # 4 experts
    dense = [f"actor_rollout_ref.model.path={save_tiny_model(tmp_path / 'dense')}"]
    ep = "actor_rollout_ref.actor.fsdp_config.expert_parallel_size"
    base = grpo_overrides(train_file)
    with nothing_started():
        check(base + moe + [f"{ep}=2", "actor_rollout_ref.actor.use_kl_loss=True"])
        with pytest.raises(ValueError, match=rf"{ep}=2: model_type='llama' has no experts to split"):
            check(base + dense + [f"{ep}=2"])
        with pytest.raises(ValueError, match=rf"{ep}=3 does not divide the model's 4 routed experts"):
            check(base + moe + ["trainer.n_gpus_per_node=3", f"{ep}=3"])
        with pytest.raises(ValueError, match=rf"{ep}=4 over 2 ranks"):
            check(base + moe + [f"{ep}=4"])
        lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
        check(base + moe + [f"{ep}=2", *lora])  # adapters on the attention compose with EP
        with pytest.raises(ValueError, match=r"target_parameters=.*expert_parallel_size=2: LoRA on experts is not"):
            check(base + moe + [f"{ep}=2", *lora, "actor_rollout_ref.model.target_parameters=[mlp.experts.down_proj]"])


def test_lora_all_linear_on_a_moe_actor_is_refused_before_ray(tmp_path, train_file):
    from hybridflow.models.moe import save_tiny_moe_model

    model = [f"actor_rollout_ref.model.path={save_tiny_moe_model(tmp_path / 'moe', 'mixtral')}",
             "actor_rollout_ref.model.lora_rank=4"]
    with nothing_started():
        with pytest.raises(ValueError, match=r"target_modules='all-linear' with LoRA on a mixture-of-experts model "
                                             r"\('mixtral'\).*target_modules=\[q_proj,k_proj,v_proj,o_proj\]"):
            check(grpo_overrides(train_file) + model)
        check(grpo_overrides(train_file) + model + ["actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"])


def test_lora_with_param_offload_on_one_gpu_is_refused_before_ray(train_file):
    """One GPU with param_offload joins a one-rank group for FSDP2's CPU offload, where LoRA's bf16 update fails
    on CUDA: refused by the config, naming both keys and the ways out."""
    base = grpo_overrides(train_file) + ["trainer.n_gpus_per_node=1", "actor_rollout_ref.model.lora_rank=4",
                                         "actor_rollout_ref.actor.fsdp_config.param_offload=True"]
    with nothing_started():
        with pytest.raises(ValueError, match=r"param_offload=True with LoRA .*lora_rank=4.* on one GPU.*"
                                             r"param_offload=False.*fsdp_config.dtype=float32"):
            check(base + ["trainer.device=cuda"])
        # Passed by this check, stopped by the next (this host has no GPU): float32 has no mixed precision, and two
        # ranks (grpo_overrides' n_gpus_per_node=2) form a real group.
        two_ranks = [override for override in base if override != "trainer.n_gpus_per_node=1"]
        for passes in (base + ["actor_rollout_ref.actor.fsdp_config.dtype=float32"], two_ranks):
            with pytest.raises(ValueError, match="trainer.device='cuda' but this machine has no CUDA device"):
                check(passes + ["trainer.device=cuda"])
    check(base + ["trainer.device=cpu"])  # the host is the device: nothing to offload to


def test_rollout_expert_parallelism_is_the_rollout_tensor_parallel_group(tmp_path, train_file):
    """A mixture-of-experts model under rollout tensor parallelism splits its experts over the group:
    expert_parallel_size is 1 (verl's default) or tensor_model_parallel_size; a dense model has none to split."""
    from hybridflow.models import save_tiny_model
    from hybridflow.models.moe import save_tiny_moe_model

    tp2 = ["actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    moe = grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={save_tiny_moe_model(tmp_path / 'moe', 'qwen2_moe')}"]
    dense = grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={save_tiny_model(tmp_path / 'dense')}"]
    with nothing_started():
        check(moe + tp2 + ["actor_rollout_ref.rollout.expert_parallel_size=2"])
        check(moe + tp2)  # verl's default expert_parallel_size=1: the experts are split over the group all the same
        with pytest.raises(ValueError, match="has no experts to split"):
            check(dense + tp2 + ["actor_rollout_ref.rollout.expert_parallel_size=2"])
        with pytest.raises(ValueError, match=r"expert_parallel_size=2 with \S*tensor_model_parallel_size=1.*set "
                                             r"\S*tensor_model_parallel_size=2 or"):
            check(moe + ["actor_rollout_ref.rollout.expert_parallel_size=2"])


def test_shape_checks_read_the_model_as_override_config_changes_it(tmp_path, train_file):
    """The layout checks before Ray read the HF config the engines will build: with override_config applied (a
    tiny model of 4 heads and 2 key/value heads; overriding the latter to 4 lets tensor_parallel_size=4 divide)."""
    from hybridflow.models import save_tiny_model

    line = grpo_overrides(train_file) + [
        f"actor_rollout_ref.model.path={save_tiny_model(tmp_path / 'dense')}", "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.train_batch_size=4",
    ]
    with nothing_started():
        with pytest.raises(ValueError, match="does not divide the model's num_key_value_heads=2"):
            check(line)
        check([*line, "+actor_rollout_ref.model.override_config.num_key_value_heads=4"])


def test_freezing_a_vision_tower_needs_one(tmp_path, train_file):
    from hybridflow.models import save_tiny_model

    line = grpo_overrides(train_file) + [f"actor_rollout_ref.model.path={save_tiny_model(tmp_path / 'dense')}",
                                         "actor_rollout_ref.actor.freeze_vision_tower=True"]
    with nothing_started(), pytest.raises(ValueError, match="freeze_vision_tower=True, but .* is a text model"):
        check(line)


def test_hybrid_sharding_groups_are_checked_against_the_ranks(tmp_path, train_file):
    """verl's fsdp_size: a divisor of the ranks passes (HSDP), another size is refused before Ray naming the key."""
    from hybridflow.models import save_tiny_model

    line = grpo_overrides(train_file) + [
        f"actor_rollout_ref.model.path={save_tiny_model(tmp_path / 'dense')}", "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
    ]
    with nothing_started():
        check([*line, "actor_rollout_ref.actor.fsdp_config.fsdp_size=2"])
        with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.fsdp_config.fsdp_size=3, .* over 4 ranks: "
                                             r"fsdp_size=3 does not divide the 4 ranks"):
            check([*line, "actor_rollout_ref.actor.fsdp_config.fsdp_size=3"])


def test_cuda_only_attention_kernels_are_refused_before_ray_where_the_workers_run_on_cpu(train_file):
    """flex_attention on CPU workers would fail in the first log-prob pass (inductor's CPU kernel does not compile
    for block masks) or update (no CPU backward): refused by the config for each model that would run it."""
    base = grpo_overrides(train_file) + ["trainer.device=cpu"]
    with nothing_started():
        for key in ("actor_rollout_ref.model", "critic.model"):
            extra = ["algorithm.adv_estimator=gae"] if key == "critic.model" else []
            with pytest.raises(ValueError, match=rf"{key}\.override_config\.attn_implementation='flex_attention' "
                                                 r"runs on CUDA ranks only \(.*CppCompileError.*use sdpa there"):
                check(base + extra + [f"+{key}.override_config.attn_implementation=flex_attention"])
        check(base + ["+actor_rollout_ref.model.override_config.attn_implementation=eager"])


def test_sandbox_limits_with_a_custom_reward_function_and_a_name_without_one_are_refused(train_file, tmp_path):
    """The local sandbox's limits configure the built-in code scorers, which custom_reward_function.path replaces;
    a function name without a file names nothing."""
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    base = grpo_overrides(train_file) + [f"custom_reward_function.path={scorer}"]
    with nothing_started():
        with pytest.raises(ValueError, match=r"reward_model.scoring.sandbox.memory_mb=64 configure the built-in "
                                             r"scorers, but custom_reward_function.path=.* replaces them"):
            check(base + ["reward_model.scoring.sandbox.memory_mb=64"])
        check(base)
        with pytest.raises(ValueError, match=r"custom_reward_function.name='my_score' names a function in "
                                             r"custom_reward_function.path's file, and no path is set"):
            check(grpo_overrides(train_file) + ["custom_reward_function.name=my_score"])
        check(grpo_overrides(train_file) + ["custom_reward_function.name=null"])


def test_an_alarm_that_stops_the_run_on_a_metric_it_never_gets_is_refused(train_file):
    """Bypass mode computes no trainer log-probs (logprob_mismatch's gap) and, without an entropy term, no entropy:
    those alarms in stop_on slept through the run."""
    from hybridflow.trainer.guards.config import unwatchable_alarms

    bypass = grpo_overrides(train_file) + ["algorithm.rollout_correction.bypass_mode=True"]
    with nothing_started():
        for alarm, fix in (("logprob_mismatch", "bypass_mode=False does"), ("entropy_collapse", "calculate_entropy=True")):
            with pytest.raises(ValueError, match=rf"stop_on lists '{alarm}', whose metric this run never produces.*{fix}"):
                check(bypass + [f"trainer.guards.alarms.stop_on=[{alarm}]"])
        check(bypass + ["trainer.guards.alarms.stop_on=[entropy_collapse,length_saturation]",
                        "actor_rollout_ref.actor.calculate_entropy=True"])
        check(grpo_overrides(train_file) + ["trainer.guards.alarms.stop_on=[logprob_mismatch,entropy_collapse]"])
    assert set(unwatchable_alarms(bypass_mode=False, rollout_log_probs=False, entropy_in_update=False)) == {
        "logprob_mismatch"}


def test_agent_loop_limits_without_agent_loops_are_refused(train_file):
    """Turn limits and agent concurrency are read only by agent loops; with the batch rollout they did nothing."""
    base = grpo_overrides(train_file) + ["actor_rollout_ref.rollout.mode=sync"]
    with nothing_started():
        for key, value in (("multi_turn.max_assistant_turns", "2"), ("agent.max_concurrent_loops", "3"),
                           ("agent.server_batch_wait_s", "1.0")):
            with pytest.raises(ValueError, match=rf"rollout.{key}={value} with .*mode=sync: it is read only by agent loops"):
                check(base + [f"actor_rollout_ref.rollout.{key}={value}"])
        check(base + ["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=null",
                      "actor_rollout_ref.rollout.multi_turn.format=hermes"])


@pytest.mark.parametrize("override", [
    "algorithm.reward_dpo_coef=2.0", "reward_model.model.beta_train=0.1", "reward_model.model.optim.lr=1e-3",
    "reward_model.model.fsdp_config.optimizer_offload=True",
])
def test_prime_settings_outside_prime_are_refused(train_file, override):
    """Only PRIME's implicit reward model trains: its optimizer's settings configured nothing in other runs."""
    key = override.split("=")[0]
    with nothing_started(), pytest.raises(ValueError, match=rf"{key}=.* configures PRIME's implicit process reward "
                                                            r"model, but algorithm.adv_estimator='grpo'"):
        check(grpo_overrides(train_file) + [override])


@pytest.mark.parametrize("override", ["reward_model.model.path=/models/my-rm", "reward_model.micro_batch_size_per_gpu=4",
                                      "reward_model.model.fsdp_config.param_offload=True"])
def test_reward_model_settings_without_a_reward_model_are_refused(train_file, override):
    """A reward model's path given without reward_model.enable=True trained on the rule scorers' rewards, silently."""
    key = override.split("=")[0]
    with nothing_started(), pytest.raises(ValueError, match=rf"{key}=.* configures the reward model, but "
                                                            r"reward_model.enable=False.*set reward_model.enable=True"):
        check(grpo_overrides(train_file) + [override])


@pytest.mark.parametrize("source, truth, message", [
    ("reasoning_gym/basic_arithmetic", "  ", "ground_truth is empty"),
    ("code", "# tests here", "nothing that can fail"),
    ("code", '{"input": ["1"], "output": ["2"]}', "must hold 'inputs' and 'outputs'"),
    ("openai/gsm8k", "Natalia sold 48 clips... #### 72", "a gsm8k ground truth must be the final number"),
])
def test_a_ground_truth_its_scorer_cannot_grade_is_refused_before_ray_naming_the_row(tmp_path, source, truth, message):
    """An empty truth scored empty answers right; code test text that cannot fail passed every program."""
    sources = ["gsm8k"] * 7 + [source]
    truths = [{"ground_truth": "4", "style": "rule"}] * 7 + [{"ground_truth": truth, "style": "rule"}]
    train_file = write_rows(tmp_path / "train.parquet", sources, reward_model=truths)
    with nothing_started(), pytest.raises(ValueError, match=rf"data.train_files entry .*: row 7 \(data_source="
                                                            rf"'{source}'\): .*{message}"):
        check(grpo_overrides(train_file))
