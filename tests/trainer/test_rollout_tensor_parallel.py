"""GRPO with a tensor-parallel rollout (native, hf) on 2 Ray workers (tiny model): each pair of ranks decodes one replica
from its shard of the actor's weights, handed over one full tensor at a time; and the layouts refused before Ray."""

from __future__ import annotations

import math

import pytest

from hybridflow.trainer.config import load_config, validate_config
from tests.helpers import nothing_started
from tests.tiny_runs import build_workspace
from tests.trainer.placement_runs import SPLIT, overrides, train

TP2 = ("actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
# The rollout's log-probs against the trainer's old log-probs of the same tokens: equal weights give ratios of 1.
DIAGNOSTICS = ("algorithm.rollout_correction.rollout_is=token",)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("rollout_tp"), train_size=8, test_size=2)


def _check_run(records: dict[int, dict], digests: list) -> None:
    assert sorted(records) == [1, 2]
    for step in (1, 2):
        record = records[step]
        for key in ("actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert math.isfinite(record[key]), f"step {step} {key}={record[key]}"
        assert record["timing_s/update_weights"] > 0  # a hand-over before every generation
        # The rollout sampled from the actor's current weights: its log-probs are the trainer's (float noise).
        assert abs(record["rollout_corr/kl"]) < 1e-4, record["rollout_corr/kl"]
        assert 0.999 < record["rollout_corr/rollout_is_min"] <= record["rollout_corr/rollout_is_max"] < 1.001
    (actor_start, _), (actor_end, _) = digests
    assert actor_end != actor_start, "the updates changed the weights"


@pytest.mark.slow  # the default suite's time budget; run with -m slow
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_grpo_with_tensor_parallel_rollout(workspace, ray_cluster, engine):
    tp2 = (f"actor_rollout_ref.rollout.name={engine}", TP2[1])
    records, digests = train(overrides(workspace, workspace / f"rollout_tp2_{engine}", *tp2, *DIAGNOSTICS))
    _check_run(records, digests)


@pytest.mark.slow  # the default suite's time budget; run with -m slow
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_agent_loops_with_a_tensor_parallel_rollout_server(workspace, ray_cluster, engine):
    """rollout.mode=async: each replica's first rank serves the agent loops' requests and drives its peer."""
    records, digests = train(overrides(
        workspace, workspace / f"async_tp2_{engine}", f"actor_rollout_ref.rollout.name={engine}", TP2[1],
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True", *DIAGNOSTICS,
    ))
    _check_run(records, digests)


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_grpo_with_lora_hands_merged_shards_to_an_hf_tensor_parallel_rollout(workspace, ray_cluster):
    records, digests = train(overrides(
        workspace, workspace / "rollout_tp2_hf_lora", "actor_rollout_ref.rollout.name=hf", TP2[1], *DIAGNOSTICS,
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=1e-2",
    ))
    _check_run(records, digests)


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_grpo_with_tensor_parallel_training_and_rollout(workspace, ray_cluster):
    # Training TP=2 hands each DTensor over as its full tensor; the rollout keeps its own TP=2 block of it.
    records, digests = train(overrides(
        workspace, workspace / "train_tp2_rollout_tp2", *TP2, *DIAGNOSTICS,
        "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2",
    ))
    _check_run(records, digests)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"], "tensor_model_parallel_size"),
        (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
         "splits a replica over accelerators only"),  # vLLM's CPU engine is a child process
        (["actor_rollout_ref.rollout.name=native", "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
         "does not divide the 2 ranks"),
        ([*TP2[:1], "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
         None),  # the tiny model: 4 heads, 2 kv heads, each replicated on 2 ranks
        ([*TP2[:1], "actor_rollout_ref.rollout.tensor_model_parallel_size=8", "trainer.n_gpus_per_node=8"],
         "does not divide the model's num_attention_heads=4"),
        ([*TP2, *SPLIT], "hybrid_engine=False"),
        (list(TP2), None),
        (["actor_rollout_ref.rollout.name=hf", TP2[1]], None),
        ([*TP2, "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True"], None),  # the leader drives
    ],
)
def test_rollout_layouts_are_refused_before_ray_starts(workspace, extra, words):
    config_overrides = overrides(workspace, workspace / "never", *extra)
    if words is None:
        with nothing_started():
            validate_config(load_config(config_overrides))
        return
    with nothing_started(), pytest.raises(ValueError) as info:
        validate_config(load_config(config_overrides))
    assert words in str(info.value) and "tensor_model_parallel_size" in str(info.value), str(info.value)


def test_vllm_splits_a_replica_where_the_workers_have_accelerators(workspace, monkeypatch):
    """The refusal above is about CPU workers only: with GPUs (counted on this machine for the embedded cluster, or
    a cluster joined by address, known once joined) the vllm layout passes the checks before Ray."""
    from hybridflow.trainer.config.parallel_checks import check_rollout_parallelism
    from hybridflow.utils import device

    vllm_tp2 = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    cpu = load_config(overrides(workspace, workspace / "never", *vllm_tp2))
    joined = load_config(overrides(workspace, workspace / "never", *vllm_tp2,
                                   "ray_kwargs.ray_init.address=10.0.0.1:6379"))
    pinned = load_config(overrides(workspace, workspace / "never", *vllm_tp2, "trainer.device=cpu"))
    assert cpu.trainer.workers_on_cpu(None) and not joined.trainer.workers_on_cpu("10.0.0.1:6379")
    check_rollout_parallelism(joined)
    monkeypatch.setattr(device, "device_count", lambda: 2)
    check_rollout_parallelism(cpu)  # auto on a machine with GPUs
    with pytest.raises(ValueError, match="over accelerators only"):
        check_rollout_parallelism(pinned)  # trainer.device=cpu, whatever the machine has


def test_config_overrides_reach_a_split_rollout_only_through_vllm(workspace):
    from hybridflow.trainer.config.model_checks import check_config_overrides_reach_the_rollout

    override = "+actor_rollout_ref.model.override_config.attention_dropout=0.0"
    native = load_config(overrides(workspace, workspace / "never", *TP2, override))
    with pytest.raises(ValueError, match="builds its shards from the checkpoint's own config"):
        check_config_overrides_reach_the_rollout(native)
    vllm = load_config(overrides(workspace, workspace / "never", "actor_rollout_ref.rollout.name=vllm", TP2[1],
                                 override))
    check_config_overrides_reach_the_rollout(vllm)  # vLLM takes them as hf_overrides in every rank's engine
