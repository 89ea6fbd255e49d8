"""On-policy distillation: a reference model other than the actor's is a teacher. Its log-probs of the policy's
own samples are the teacher's (checked against transformers), the per-token reverse-KL estimate is what the KL
terms then penalise, and a teacher with another vocabulary is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.algorithms import kl_penalty
from hybridflow.engines.rollout import RolloutConfig
from hybridflow.models import build_local_tokenizer, save_tiny_model
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.config import (
    ActorConfig,
    ActorRolloutRefConfig,
    RefConfig,
    RefModelConfig,
    WorkerRuntimeConfig,
)

PROMPT_LEN, RESPONSE_LEN, BATCH = 6, 5, 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return {
        "student": str(save_tiny_model(root / "student", seed=0)),
        "teacher": str(save_tiny_model(root / "teacher", num_layers=3, hidden=96, seed=7)),
        "other_vocab": str(save_tiny_model(root / "other", seed=1, tokenizer=build_local_tokenizer())),
    }


def group(student: str, teacher: str | None) -> LocalWorkerGroup:
    config = ActorRolloutRefConfig(
        model=ModelConfig(path=student),
        actor=ActorConfig(ppo_mini_batch_size=BATCH, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True),
        rollout=RolloutConfig(name="native", temperature=1.0, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN),
        ref=RefConfig(model=RefModelConfig(path=teacher)),
    )
    workers = LocalWorkerGroup(RayClassWithInitArgs(
        ActorRolloutRefWorker, config, "actor_rollout_ref", WorkerRuntimeConfig(seed=0, num_threads=1)
    ))
    workers.init_model()
    return workers


def hf_log_probs(path: str, batch: DataProto) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits[:, PROMPT_LEN - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.batch["responses"][..., None]).squeeze(-1)


def test_the_teacher_scores_the_students_samples(models):
    workers = group(models["student"], models["teacher"])
    ids = torch.randint(5, 300, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    torch.manual_seed(0)
    batch = workers.generate_sequences(DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    ))
    teacher = workers.compute_ref_log_prob(batch).batch["ref_log_prob"]
    student = workers.compute_log_prob(batch).batch["old_log_probs"]
    response_mask = batch.batch["response_mask"].bool()
    expected_teacher = hf_log_probs(models["teacher"], batch)
    assert torch.allclose(teacher[response_mask], expected_teacher[response_mask], atol=1e-4)
    assert torch.allclose(student[response_mask], hf_log_probs(models["student"], batch)[response_mask], atol=1e-4)
    # The reverse-KL estimate the KL terms use (k1: log pi_student - log pi_teacher per sampled token).
    reverse_kl = kl_penalty(student, teacher, "kl")
    assert torch.allclose(reverse_kl, student - teacher)
    assert reverse_kl[response_mask].abs().mean() > 0.01, "a different teacher disagrees with the student"


def test_without_a_teacher_the_reference_is_the_initial_actor(models):
    workers = group(models["student"], None)
    ids = torch.randint(5, 300, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    batch = workers.generate_sequences(DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    ))
    ref = workers.compute_ref_log_prob(batch).batch["ref_log_prob"]
    assert torch.allclose(ref, workers.compute_log_prob(batch).batch["old_log_probs"], atol=1e-6)


def test_a_teacher_with_another_vocabulary_is_refused(models):
    with pytest.raises(Exception, match="tokenizer differs from the policy's"):
        group(models["student"], models["other_vocab"])
