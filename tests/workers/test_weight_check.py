"""Weight delivery verified: a rollout that silently keeps stale weights is caught at the next hand-over, naming
the tensor, the rank and the policy version (`workers.weight_check`)."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.models.tiny import build_tiny_model
from hybridflow.engines.rollout.base import tensor_sum
from hybridflow.workers.weight_check import WeightDeliveryCheck, WeightDeliveryError, pick_sample


def test_sample_and_fingerprint_hand_computed():
    assert pick_sample(list("abcdefghij"), 4) == ["a", "d", "g", "j"]
    assert pick_sample(["x", "y"], 4) == ["x", "y"]
    assert tensor_sum(torch.tensor([1.0, 2.5, -0.5]), torch.float32) == 3.0
    # cast to the serving dtype first: 1 + 2**-10 is 1 in bfloat16
    assert tensor_sum(torch.tensor([1.0 + 2**-10]), torch.bfloat16) == 1.0


@torch.no_grad()
def train_a_step(model: torch.nn.Module, step: int) -> None:
    for index, parameter in enumerate(model.parameters()):
        parameter.add_(1e-3 * (step + index + 1))


def test_a_rollout_that_keeps_stale_weights_is_caught_at_the_next_hand_over(monkeypatch):
    actor, tokenizer = build_tiny_model(seed=0)
    rollout = HFRollout(copy.deepcopy(actor), tokenizer, SamplingParams(max_new_tokens=4))
    check = WeightDeliveryCheck(rollout, rank=1)
    assert len(check.expected_shapes) == 8

    train_a_step(actor, 1)
    rollout.update_weights(check.record(actor.named_parameters()))
    metrics = check.verify(version=1)
    assert metrics == {"rollout/weights_checked": 8.0, "rollout/weights_version": 1.0}

    def update_that_skips(named_tensors):  # the silent failure: the tensors arrive, nothing is loaded
        for _ in named_tensors:
            pass

    monkeypatch.setattr(rollout, "update_weights", update_that_skips)
    train_a_step(actor, 2)
    rollout.update_weights(check.record(actor.named_parameters()))
    with pytest.raises(WeightDeliveryError, match=r"rank 1: .*policy version 2.*tensor 'model\.embed_tokens\.weight'"):
        check.verify(version=2)


def test_a_hand_over_under_other_names_is_caught(monkeypatch):
    actor, tokenizer = build_tiny_model(seed=0)
    rollout = HFRollout(copy.deepcopy(actor), tokenizer, SamplingParams(max_new_tokens=4))
    check = WeightDeliveryCheck(rollout, rank=0)
    # a backend that ignores names it does not know, handed names without the rollout's mapping (e.g. peft's)
    monkeypatch.setattr(rollout, "update_weights", lambda named_tensors: [None for _ in named_tensors])
    renamed = ((f"base_model.{name}", tensor) for name, tensor in actor.named_parameters())
    rollout.update_weights(check.record(renamed))
    with pytest.raises(WeightDeliveryError, match="carried none of the rollout's sampled tensors"):
        check.verify(version=1)


def _tensor_parallel_hand_overs(rank: int, world_size: int, model_dir: str, out_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.engines.rollout import NativeRollout
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("rollout_dp", "rollout_tp"))["rollout_tp"]
    rollout = NativeRollout(model_dir, tokenizer, SamplingParams(max_new_tokens=4), kernels="torch", tp_mesh=mesh)
    check = WeightDeliveryCheck(rollout, rank=rank)
    actor, _ = build_tiny_model(seed=0, tokenizer=tokenizer)
    train_a_step(actor, 1)
    rollout.update_weights(check.record(actor.named_parameters()))
    metrics = check.verify(version=1)  # every rank's shard loaded: the reassembled tensors match
    original_update = rollout.update_weights

    def stale_on_rank_1(named_tensors):  # rank 1 silently keeps its old shard of every tensor
        if rank == 1:
            for _ in named_tensors:
                pass
        else:
            original_update(named_tensors)

    rollout.update_weights = stale_on_rank_1
    train_a_step(actor, 2)
    rollout.update_weights(check.record(actor.named_parameters()))
    try:
        check.verify(version=2)
        error = None
    except WeightDeliveryError as err:
        error = str(err)
    torch.save({"metrics": metrics, "error": error}, f"{out_file}.{rank}")


@pytest.mark.slow  # the suite's budget: two processes; the one-process stale-weight test runs by default
def test_a_tensor_parallel_rank_that_keeps_its_old_shard_is_caught(tmp_path):
    """Rollout TP=2 (native): the fingerprints compare the full tensors reassembled from the group's shards, so a
    hand-over that one rank silently skips is caught on every rank of the group."""
    from hybridflow.models import save_tiny_model
    from tests.engines.helpers import run_distributed

    out = str(tmp_path / "result")
    run_distributed(_tensor_parallel_hand_overs, 2, str(save_tiny_model(tmp_path / "tiny")), out)
    for rank in (0, 1):
        result = torch.load(f"{out}.{rank}")
        assert result["metrics"]["rollout/weights_checked"] == 8.0
        assert result["error"] and "policy version 2" in result["error"] and f"rank {rank}:" in result["error"]
