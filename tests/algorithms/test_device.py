"""Every algorithm runs on CUDA tensors and gives the CPU numbers (skipped without a GPU)."""

import numpy as np
import pytest
import torch

import hybridflow.algorithms as alg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BS, LEN = 8, 6
INDEX = np.array(list("aabbccdd"), dtype=object)


def make_inputs():
    torch.manual_seed(0)
    mask = (torch.rand(BS, LEN) > 0.3).float()
    mask[:, 0] = 1
    return {
        "rewards": torch.randn(BS, LEN) * mask,
        "values": torch.randn(BS, LEN),
        "mask": mask,
        "old": -torch.rand(BS, LEN),
        "new": -torch.rand(BS, LEN),
        "adv": torch.randn(BS, 1).expand(BS, LEN).contiguous(),
        "baselines": torch.randn(BS),
        "weights": torch.rand(BS, LEN) + 0.5,
    }


CPU = make_inputs()


@pytest.fixture(scope="module")
def gpu_inputs():
    return {k: v.cuda() for k, v in CPU.items()}


def assert_close(on_gpu, on_cpu):
    on_gpu = on_gpu if isinstance(on_gpu, tuple) else (on_gpu,)
    on_cpu = on_cpu if isinstance(on_cpu, tuple) else (on_cpu,)
    for g, c in zip(on_gpu, on_cpu, strict=True):
        if torch.is_tensor(g):
            assert g.is_cuda
            assert torch.allclose(g.cpu().double(), c.double(), atol=1e-5)


@pytest.mark.parametrize("name", alg.ADV_ESTIMATORS.names())
def test_estimators(name, gpu_inputs):
    def run(d):
        return alg.compute_advantage_by_name(
            name,
            token_level_rewards=d["rewards"],
            response_mask=d["mask"],
            index=INDEX,
            values=d["values"],
            reward_baselines=d["baselines"],
            gamma=0.9,
            lam=0.8,
        )

    assert_close(run(gpu_inputs), run(CPU))


@pytest.mark.parametrize("name", alg.POLICY_LOSSES.names())
def test_policy_losses(name, gpu_inputs):
    cfg = alg.PPOLossConfig(policy_loss=alg.PolicyLossConfig(loss_mode=name, kl_cov_ratio=0.1))

    def run(d):
        new = d["new"].clone().requires_grad_(True)
        loss, metrics = alg.compute_policy_loss_from_config(cfg, d["old"], new, d["adv"], d["mask"], d["weights"])
        loss.backward()
        return loss, new.grad, metrics

    g_loss, g_grad, g_metrics = run(gpu_inputs)
    c_loss, c_grad, c_metrics = run(CPU)
    assert_close((g_loss, g_grad), (c_loss, c_grad))
    # The metrics stay on the loss's device (reading them would wait on it every micro-batch): compare on the host.
    assert g_metrics.keys() == c_metrics.keys()
    assert _on_host(g_metrics) == pytest.approx(_on_host(c_metrics), abs=1e-5)


def _on_host(metrics: dict) -> dict[str, float]:
    return {key: float(torch.as_tensor(value).detach().cpu()) for key, value in metrics.items()}


def test_kl_agg_value_entropy_and_metrics(gpu_inputs):
    gpu = gpu_inputs
    for name in alg.KL_PENALTY_TYPES:
        assert_close(alg.kl_penalty(gpu["new"], gpu["old"], name), alg.kl_penalty(CPU["new"], CPU["old"], name))
    for mode in alg.LOSS_AGG_MODES:
        assert_close(alg.agg_loss(gpu["values"], gpu["mask"], mode), alg.agg_loss(CPU["values"], CPU["mask"], mode))
    args = ("values", "rewards", "old", "mask")
    assert_close(
        alg.compute_value_loss(*(gpu[k] for k in args), 0.2), alg.compute_value_loss(*(CPU[k] for k in args), 0.2)
    )
    logits = torch.randn(4, 5, 33)
    assert_close(alg.entropy_from_logits_with_chunking(logits.cuda(), 3), alg.entropy_from_logits(logits))

    rewards, kl_metrics = alg.apply_kl_penalty(
        gpu["rewards"], gpu["old"], gpu["new"], gpu["mask"], alg.AdaptiveKLController(0.1, 0.1, 10), "k3"
    )
    attention_mask = torch.cat([torch.ones(BS, 3, device="cuda"), gpu["mask"]], dim=1)
    batch = {
        "token_level_scores": gpu["rewards"],
        "token_level_rewards": rewards,
        "advantages": gpu["adv"],
        "returns": gpu["rewards"],
        "values": gpu["values"],
        "responses": torch.zeros(BS, LEN, dtype=torch.long, device="cuda"),
        "attention_mask": attention_mask,
        "response_mask": gpu["mask"],
    }
    metrics = (
        alg.compute_data_metrics(batch) | alg.compute_timing_metrics(batch, {"gen": 1.0, "step": 2.0}) | kl_metrics
    )
    assert all(isinstance(v, float) for v in metrics.values())
