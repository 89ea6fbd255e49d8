"""`hybridflow generate` (verl's main_generation): verl's command lines pass --dry-run, bad settings are refused
before Ray, and a run writes every row back with n different responses; the sampling seed of a call offset."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.generation_checks import IGNORED_BY_GENERATION, validate_generation_config
from hybridflow.trainer.config.loader import GENERATION_TREE
from hybridflow.trainer.main_generation import main as generate_main
from hybridflow.workers.actor_rollout_ref import sampling_seed
from tests.helpers import nothing_started


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A tiny model and a parquet of 5 chat prompts in verl's layout."""
    from hybridflow.models import build_local_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("generate")
    save_tiny_model(root / "tiny", tokenizer=build_local_tokenizer(), num_layers=2, hidden=64, seed=0)
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "extra_info": {"index": i}} for i in range(5)]
    pd.DataFrame(rows).to_parquet(root / "test.parquet")
    return root


def line(root, output, *extra: str) -> list[str]:
    """verl's tests/special_e2e/generation/run_gen_qwen05.sh with this machine's model, data and sizes."""
    return ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", f"data.path={root / 'test.parquet'}", "data.prompt_key=prompt",
            "data.n_samples=1", f"data.output_path={output}", f"model.path={root / 'tiny'}", "+model.trust_remote_code=True",
            "rollout.temperature=1.0", "rollout.top_k=50", "rollout.top_p=0.7", "rollout.prompt_length=64",
            "rollout.response_length=6", "rollout.tensor_model_parallel_size=1", "rollout.gpu_memory_utilization=0.8",
            *extra]


def test_verl_s_generation_line_passes_dry_run(prompts, tmp_path, capsys):
    args = line(prompts, tmp_path / "gen" / "out.parquet", "trainer.n_gpus_per_node=4",
                "rollout.tensor_model_parallel_size=2")
    with nothing_started():
        assert generate_main(["--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert "prompts (rows of data.path)                    5" in out
    assert "replicas (ranks / tensor_model_parallel_size)  2" in out
    assert not (tmp_path / "gen").exists()


@pytest.mark.parametrize("extra, message", [
    (("rollout.n=2",), "rollout.n=2: each generation call samples one response per prompt; set data.n_samples"),
    (("data.n_samples=2", "rollout.temperature=0"), "data.n_samples=2 with greedy decoding"),
    (("data.prompt_key=question",), "data.prompt_key='question' is not a column"),
    (("rollout.mode=async",), "set rollout.mode=sync"),
    (("trainer.n_gpus_per_node=3", "rollout.tensor_model_parallel_size=2"), "does not divide the 3 ranks"),
    (("rollout.prompt_length=2048", "rollout.response_length=4096"), "exceeds the model's context"),
    (("actor.ulysses_sequence_parallel_size=2",), "generation runs no training forward"),
])
def test_bad_settings_are_refused_before_ray(prompts, tmp_path, extra, message):
    with nothing_started(), pytest.raises(ValueError, match=message):
        validate_generation_config(load_config(line(prompts, tmp_path / "out.parquet", *extra), GENERATION_TREE))


_NO_ENGINE = "generation builds no training engine"
_MERGE_FIRST = ("generation loads the plain weights of model.path and applies no LoRA adapter: merge the adapter into "
                "them first (a hybridflow checkpoint: `hybridflow merge --local_dir")
IGNORED_KEYS = [  # (overrides, the key named, its reason): one case at least for every IGNORED_BY_GENERATION entry
    (("model.lora_adapter_path={adapter}",), "model.lora_adapter_path='{adapter}'", _MERGE_FIRST),
    (("model.lora_rank=8",), "model.lora_rank=8", _MERGE_FIRST),
    (("model.lora_alpha=32",), "model.lora_alpha=32.0", _NO_ENGINE),
    (("model.target_modules=[q_proj]",), "model.target_modules=['q_proj']", _NO_ENGINE),
    (("model.lora_rank=8", "model.target_parameters=[mlp.experts.gate_up_proj]"),
     "model.target_parameters=['mlp.experts.gate_up_proj']", _NO_ENGINE),
    (("model.exclude_modules=[o_proj]",), "model.exclude_modules=['o_proj']", _NO_ENGINE),
    (("model.enable_gradient_checkpointing=True",), "model.enable_gradient_checkpointing=True", _NO_ENGINE),
    (("model.enable_activation_offload=True",), "model.enable_activation_offload=True", _NO_ENGINE),
    (("model.use_remove_padding=True",), "model.use_remove_padding=True", _NO_ENGINE),
    (("model.use_fused_kernels=False",), "model.use_fused_kernels=False", _NO_ENGINE),
    (("model.fused_kernel_options.chunk_size=512",), "model.fused_kernel_options.chunk_size=512", _NO_ENGINE),
    (("rollout.val_kwargs.temperature=0.7", "rollout.val_kwargs.do_sample=True"), "rollout.val_kwargs.do_sample=True",
     "generation samples with rollout.temperature/top_p/top_k/do_sample; set those"),
    (("rollout.log_prob_micro_batch_size=4",), "rollout.log_prob_micro_batch_size=4", "generation computes no log-probs"),
    (("rollout.log_prob_micro_batch_size_per_gpu=4",), "rollout.log_prob_micro_batch_size_per_gpu=4",
     "generation computes no log-probs"),
    (("rollout.log_prob_use_dynamic_bsz=True",), "rollout.log_prob_use_dynamic_bsz=True", "generation computes no log-probs"),
    (("rollout.calculate_log_probs=True",), "rollout.calculate_log_probs=True", "generation writes no log-probs"),
    (("rollout.log_prob_max_token_len_per_gpu=4096",), "rollout.log_prob_max_token_len_per_gpu=4096",
     "generation computes no log-probs"),
    (("rollout.agent.max_concurrent_loops=3",), "rollout.agent.max_concurrent_loops=3",
     "generation runs batch generation, no agent loops or tools"),
    (("rollout.multi_turn.tool_config_path=/tmp/no_such_tools.yaml",),
     "rollout.multi_turn.tool_config_path='/tmp/no_such_tools.yaml'", "generation runs batch generation, no agent loops"),
    (("rollout.multi_turn.interaction_config_path=/tmp/x.yaml",), "rollout.multi_turn.interaction_config_path='/tmp/x.yaml'",
     "generation runs batch generation, no agent loops"),
    (("rollout.multi_turn.max_assistant_turns=2",), "rollout.multi_turn.max_assistant_turns=2",
     "generation runs batch generation, no agent loops"),
    (("rollout.profiler.enable=True", "rollout.profiler.tool=torch"), "rollout.profiler.tool='torch'",
     "hybridflow generate does not profile"),
    (("rollout.skip_rollout=True",), "rollout.skip_rollout=True", "`hybridflow train` only"),
    (("rollout.skip_dump_dir=/tmp/dump",), "rollout.skip_dump_dir='/tmp/dump'", "`hybridflow train` only"),
    (("rollout.enable_rollout_routing_replay=True",), "rollout.enable_rollout_routing_replay=True", "`hybridflow train` only"),
]


@pytest.fixture
def adapter(tmp_path):
    """A peft adapter directory, as far as the config reads one (its adapter_config.json)."""
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    return tmp_path / "adapter"


@pytest.mark.parametrize("extra, key, reason", IGNORED_KEYS)
def test_keys_generation_never_reads_are_refused_off_their_defaults(prompts, tmp_path, adapter, extra, key, reason):
    extra = [override.format(adapter=adapter) for override in extra]
    with nothing_started(), pytest.raises(ValueError) as refused:
        validate_generation_config(load_config(line(prompts, tmp_path / "out.parquet", *extra), GENERATION_TREE))
    assert f"{key.format(adapter=adapter)}: {reason}" in str(refused.value)


def test_every_ignored_key_has_a_refusal_case():
    named = [key.split("=")[0] for _, key, _ in IGNORED_KEYS]
    assert [path for path in IGNORED_BY_GENERATION if not any(name.startswith(path) for name in named)] == []


def test_ignored_keys_at_their_defaults_pass(prompts, tmp_path):
    """verl's generation.yaml values (log_prob_micro_batch_size_per_gpu: 8) and PPO lines' defaults, written out."""
    defaults = ["rollout.log_prob_micro_batch_size_per_gpu=8", "rollout.log_prob_micro_batch_size=null",
                "model.lora_rank=0", "model.lora_alpha=16", "model.target_modules=all-linear", "model.use_fused_kernels=True",
                "model.use_remove_padding=False", "rollout.val_kwargs.temperature=0", "rollout.val_kwargs.do_sample=False",
                "rollout.multi_turn.enable=False", "rollout.profiler.enable=False", "rollout.skip_rollout=False",
                "rollout.enable_rollout_routing_replay=False"]
    rows = validate_generation_config(load_config(line(prompts, tmp_path / "out.parquet", *defaults), GENERATION_TREE))
    assert ("prompts (rows of data.path)", 5) in rows


def test_an_ignored_key_of_the_server_line_is_named_as_written(prompts, tmp_path, capsys):
    from hybridflow.trainer.main_generation_server import main as server_main

    args = [f"actor_rollout_ref.model.path={prompts / 'tiny'}", "actor_rollout_ref.rollout.prompt_length=64",
            "actor_rollout_ref.rollout.response_length=6", f"data.train_files={prompts / 'test.parquet'}",
            f"+data.output_path={tmp_path / 'out.parquet'}", "actor_rollout_ref.model.use_remove_padding=True"]
    with nothing_started():
        assert server_main(["--dry-run", *args]) == 2
    assert "actor_rollout_ref.model.use_remove_padding=True: generation builds no training engine" in capsys.readouterr().err


def test_an_existing_output_is_never_written_over(prompts, tmp_path, capsys):
    output = tmp_path / "out.parquet"
    output.write_text("keep me")
    assert generate_main(line(prompts, output)) == 2
    assert "exists; generation never writes over a file" in capsys.readouterr().err
    assert output.read_text() == "keep me"


def test_a_run_writes_each_row_with_n_different_responses(prompts, tmp_path, ray_cluster):
    """On a Ray worker, the command's default (the local mode is the generation server test's): a run directory
    check broke it once while every local-mode test passed."""
    output = tmp_path / "nested" / "out.parquet"
    args = line(prompts, output, "trainer.device=cpu", "data.n_samples=3", "data.batch_size=2",
                f"trainer.default_local_dir={tmp_path / 'hung_stacks'}")
    assert cli_main(["generate", *args]) == 0
    frame = pd.read_parquet(output)
    assert len(frame) == 5 and list(frame.columns) == ["data_source", "prompt", "extra_info", "responses"]
    assert [row["index"] for row in frame["extra_info"]] == list(range(5))  # rows keep their order and columns
    for responses in frame["responses"]:
        assert len(responses) == 3 and all(isinstance(text, str) and text for text in responses)
        assert len(set(responses)) == 3, responses  # each sample has its own stream
    assert [path.name for path in output.parent.iterdir()] == ["out.parquet"]  # no staging file left behind


def test_sampling_seeds_of_call_offsets_differ_on_cpu():
    """torch's CPU generator keeps the low 32 bits of a seed: every offset must change them."""
    draws = []
    for offset in range(4):
        torch.manual_seed(sampling_seed(1, 0, 0, offset))
        draws.append(torch.rand(3).tolist())
    assert len({tuple(draw) for draw in draws}) == 4
    assert sampling_seed(1, 2, 5, 0) == 1 + 1_000_003 * 3 + 5  # offset 0 keeps the earlier seeds


def test_ray_s_timeline_is_never_written_over_a_file(prompts, tmp_path):
    existing = tmp_path / "timeline.json"
    existing.write_text("{}")
    cfg = load_config(line(prompts, tmp_path / "out.parquet", f"ray_kwargs.timeline_json_file={existing}"),
                      GENERATION_TREE)
    with pytest.raises(ValueError, match="timeline_json_file=.* exists"):
        validate_generation_config(cfg)


@pytest.mark.slow  # two Ray workers, outside the default suite's time budget: `make test-all`
def test_two_ray_workers_split_padded_batches_and_write_the_timeline(prompts, tmp_path, ray_cluster):
    output = tmp_path / "out" / "gen.parquet"
    timeline = tmp_path / "out" / "timeline.json"
    args = line(prompts, output, "trainer.n_gpus_per_node=2", "trainer.device=cpu", "data.n_samples=2",
                "data.batch_size=3", f"ray_kwargs.timeline_json_file={timeline}")
    assert generate_main(args) == 0
    frame = pd.read_parquet(output)
    assert len(frame) == 5 and all(len(set(responses)) == 2 for responses in frame["responses"])
    assert timeline.read_text().startswith("[")


def test_rows_that_are_not_chats_are_refused_naming_the_row(prompts, tmp_path):
    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "hi"}], [{"text": "no role"}]]}).to_parquet(bad)
    args = [arg if not arg.startswith("data.path=") else f"data.path={bad}" for arg in line(prompts, tmp_path / "o.parquet")]
    with nothing_started(), pytest.raises(ValueError, match=r"bad.parquet row 1: column 'prompt' must hold chat messages"):
        validate_generation_config(load_config(args, GENERATION_TREE))


def test_verl_s_generation_server_line_writes_rollout_n_responses_per_row(prompts, tmp_path, capsys):
    """verl's tests/special_e2e/generation/run_gen_qwen05_server.sh (main_generation_server: PPO keys, samples as
    actor_rollout_ref.rollout.n), on this machine's model, data and sizes."""
    from hybridflow.trainer.main_generation_server import main as server_main

    output = tmp_path / "server" / "out.parquet"
    line = ["trainer.nnodes=1", "trainer.n_gpus_per_node=1", f"actor_rollout_ref.model.path={prompts / 'tiny'}",
            "actor_rollout_ref.model.trust_remote_code=True", "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.rollout.top_k=50", "actor_rollout_ref.rollout.top_p=0.7",
            "actor_rollout_ref.rollout.prompt_length=64", "actor_rollout_ref.rollout.response_length=6",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=3",
            f"data.train_files={prompts / 'test.parquet'}", "data.prompt_key=prompt", f"+data.output_path={output}"]
    assert server_main(["--dry-run", *line]) == 0
    assert "responses per prompt (data.n_samples)          3" in capsys.readouterr().out
    assert server_main([*line, "actor_rollout_ref.rollout.temperature=0"]) == 2
    assert "actor_rollout_ref.rollout.n=3 with greedy decoding" in capsys.readouterr().err  # named as written
    assert server_main([*line, "trainer.local_mode=true"]) == 0
    frame = pd.read_parquet(output)
    assert len(frame) == 5 and all(len(responses) == 3 for responses in frame["responses"])

