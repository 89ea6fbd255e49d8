"""`fsdp_config.optimizer_offload` in every worker that trains an engine (actor, critic, SFT, PRIME's implicit PRM):
the optimizer state comes to the device before the update's optimizer steps and goes back to the host after them;
the reference, which has no optimizer, refuses the key before Ray.

On CPU the engine's moves are no-ops (`FSDPEngine._move`), so these tests record the calls a real tiny update makes
instead of the state's device; the GPU runs (`tests/gpu/test_trainer_gpu.py`) move real state.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig
from hybridflow.engines.training.config import FSDPModelConfig
from hybridflow.models import load_tokenizer, save_tiny_model
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.workers.config import ActorConfig, ActorRolloutRefConfig, CriticConfig, WorkerRuntimeConfig
from hybridflow.workers.offload import optimizer_on_device
from hybridflow.workers.reward_config import RewardModelModelConfig, RewardModelWorkerConfig
from tests.engines.helpers import make_batch

LOAD = "load_to_device(model=False, optimizer=True)"
OFFLOAD = "offload_to_cpu(model=False, optimizer=True)"
RUNTIME = WorkerRuntimeConfig(seed=0, num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("offload") / "tiny", num_layers=2, hidden=64, seed=0))


def record_engine_calls(engine, monkeypatch) -> list[str]:
    """The engine's moves and optimizer steps (`train_batch`), in order, as they happen (each still runs)."""
    calls: list[str] = []

    def recording(name: str):
        method = getattr(engine, name)

        def call(*args, **kwargs):
            shown = ", ".join(f"{key}={value}" for key, value in kwargs.items())
            calls.append(f"{name}({shown})" if name != "train_batch" else name)
            return method(*args, **kwargs)

        return call

    for name in ("load_to_device", "offload_to_cpu", "train_batch"):
        monkeypatch.setattr(engine, name, recording(name))
    return calls


def check_update_calls(calls: list[str], optimizer_offload: bool) -> None:
    """One load before the first optimizer step and one offload after the last, with the offload; else neither."""
    steps = calls.count("train_batch")
    assert steps >= 1, calls
    expected = [LOAD, *["train_batch"] * steps, OFFLOAD] if optimizer_offload else ["train_batch"] * steps
    assert calls == expected


def local_group(cls, *args):
    group = LocalWorkerGroup(RayClassWithInitArgs(cls, *args), world_size=1)
    group.init_model()
    return group, group.workers[0]


def ppo_batch(model_dir: str) -> DataProto:
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=4, seed=1)
    shape = batch.batch["responses"].shape
    batch.batch["old_log_probs"] = torch.zeros(shape)
    batch.batch["advantages"] = torch.linspace(-1, 1, shape[0])[:, None].expand(shape).contiguous()
    batch.batch["values"] = torch.zeros(shape)
    batch.batch["returns"] = torch.ones(shape)
    return batch


# ----------------------------------------------------------------------------- the shared context manager
class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def load_to_device(self, *, model: bool, optimizer: bool) -> None:
        self.calls.append(f"load_to_device(model={model}, optimizer={optimizer})")

    def offload_to_cpu(self, *, model: bool, optimizer: bool) -> None:
        self.calls.append(f"offload_to_cpu(model={model}, optimizer={optimizer})")


def test_optimizer_on_device_moves_only_with_the_offload_and_also_after_a_failed_update():
    engine = FakeEngine()
    with optimizer_on_device(engine, False):
        engine.calls.append("update")
    assert engine.calls == ["update"]
    engine.calls.clear()
    with optimizer_on_device(engine, True):
        engine.calls.append("update")
    assert engine.calls == [LOAD, "update", OFFLOAD]
    engine.calls.clear()
    with pytest.raises(RuntimeError, match="boom"), optimizer_on_device(engine, True):
        raise RuntimeError("boom")
    assert engine.calls == [LOAD, OFFLOAD], "the state goes back to the host when the update fails"


# ----------------------------------------------------------------------------- the workers
@pytest.mark.parametrize("optimizer_offload", [True, False])
def test_actor_update_offloads_the_optimizer(model_dir, monkeypatch, optimizer_offload):
    from hybridflow.workers import ActorRolloutRefWorker

    actor = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-3),
                        fsdp_config=FSDPConfig(optimizer_offload=optimizer_offload))
    config = ActorRolloutRefConfig(model=ModelConfig(path=model_dir), actor=actor)
    group, worker = local_group(ActorRolloutRefWorker, config, "actor", RUNTIME)
    calls = record_engine_calls(worker.actor_engine, monkeypatch)
    group.update_actor(ppo_batch(model_dir))
    check_update_calls(calls, optimizer_offload)
    assert calls.count("train_batch") == 2, "two mini-batches: the state stays on the device between them"


@pytest.mark.parametrize("optimizer_offload", [True, False])
def test_critic_update_offloads_the_optimizer(model_dir, monkeypatch, optimizer_offload):
    from hybridflow.workers import CriticWorker

    model = FSDPModelConfig(path=model_dir, fsdp_config=FSDPConfig(optimizer_offload=optimizer_offload))
    config = CriticConfig(model=model, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                          optim=OptimConfig(lr=1e-3))
    group, worker = local_group(CriticWorker, config, 1, RUNTIME)
    calls = record_engine_calls(worker.engine, monkeypatch)
    group.update_critic(ppo_batch(model_dir))
    check_update_calls(calls, optimizer_offload)
    assert calls.count("train_batch") == 2, "two mini-batches: the state stays on the device between them"


@pytest.mark.parametrize("optimizer_offload", [True, False])
def test_sft_step_offloads_the_optimizer(model_dir, monkeypatch, optimizer_offload):
    from hybridflow.workers import SFTWorker

    engine_config = FSDPEngineConfig(
        model=ModelConfig(path=model_dir), fsdp=FSDPConfig(optimizer_offload=optimizer_offload),
        optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=2,
    )
    group, worker = local_group(SFTWorker, engine_config, RUNTIME)
    calls = record_engine_calls(worker.engine, monkeypatch)
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=4, seed=2)
    batch = DataProto.from_dict({key: batch.batch[key] for key in ("input_ids", "attention_mask", "position_ids")})
    batch.batch["loss_mask"] = batch.batch["attention_mask"].clone()
    group.train_step(batch)
    check_update_calls(calls, optimizer_offload)


@pytest.mark.parametrize("optimizer_offload", [True, False])
def test_prime_update_offloads_the_optimizer_of_the_implicit_prm(model_dir, monkeypatch, optimizer_offload):
    from hybridflow.workers import PrimeRewardModelWorker

    model = RewardModelModelConfig(path=model_dir, update="before", optim=OptimConfig(lr=1e-3),
                                   fsdp_config=FSDPConfig(optimizer_offload=optimizer_offload))
    config = RewardModelWorkerConfig(enable=True, model=model, micro_batch_size_per_gpu=2)
    group, worker = local_group(PrimeRewardModelWorker, config, RUNTIME)
    calls = record_engine_calls(worker.prm, monkeypatch)
    reference_calls = record_engine_calls(worker.ref, monkeypatch)
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=4, seed=3)
    batch.batch["acc"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    group.update_rm(batch)
    check_update_calls(calls, optimizer_offload)
    assert reference_calls == [], "the frozen reference has no optimizer to move"


# ----------------------------------------------------------------------------- the reference refuses the key
def test_reference_refuses_optimizer_offload_before_ray_and_the_actors_stays_its_own():
    from hybridflow.trainer.config.loader import load_config

    base = ["actor_rollout_ref.model.path=/tmp/unused-model", "data.train_files=/tmp/unused.parquet"]
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.ref\.fsdp_config\.optimizer_offload=True is not "
                                         r"supported.*the reference is frozen and has no optimizer"):
        load_config([*base, "actor_rollout_ref.ref.fsdp_config.optimizer_offload=True"])
    cfg = load_config([*base, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                       "actor_rollout_ref.ref.fsdp_config.optimizer_offload=False"])
    assert cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload
    assert not cfg.actor_rollout_ref.ref.fsdp_config.optimizer_offload, "the actor's value never reaches the reference"
