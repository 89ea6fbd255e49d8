"""Device and backend choice as pure functions (what a GPU host gets is decided without one)."""

from __future__ import annotations


def test_dist_backend_pairs_gloo_with_nccl_on_cuda_hosts(monkeypatch):
    """CPU tensors (counts, offloaded parameters) need a backend on GPU hosts too."""
    from hybridflow.utils import device

    monkeypatch.setattr(device, "get_device_name", lambda: "cuda")
    assert device.get_dist_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(device, "get_device_name", lambda: "cpu")
    assert device.get_dist_backend() == "gloo"
