"""Device and backend choice as pure functions (what a GPU host gets is decided without one)."""

from __future__ import annotations


def test_dist_backend_pairs_gloo_with_nccl_on_cuda_hosts(monkeypatch):
    """CPU tensors (counts, offloaded parameters) need a backend on GPU hosts too."""
    from hybridflow.utils import device

    monkeypatch.setattr(device, "get_device_name", lambda: "cuda")
    assert device.get_dist_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(device, "get_device_name", lambda: "cpu")
    assert device.get_dist_backend() == "gloo"


def test_workers_get_gpus_when_the_cluster_has_them_whatever_the_driver_sees(monkeypatch):
    """auto decides from the Ray cluster's resources, not the driver's devices (a CPU-only head or driver)."""
    import pytest
    import ray

    from hybridflow.trainer.config.schema import RunConfig
    from hybridflow.trainer.scaffold import use_accelerator

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 32.0, "GPU": 8.0})
    assert use_accelerator(RunConfig()) is True and use_accelerator(RunConfig(device="cpu")) is False
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 32.0})
    assert use_accelerator(RunConfig()) is False
    with pytest.raises(RuntimeError, match="trainer.device='cuda' but the Ray cluster has no GPU"):
        use_accelerator(RunConfig(device="cuda"))
