"""benchmarks/gpu_profile.py runs on CPU with tiny models and prints every table the GPU run prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_cpu_run_prints_every_table(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_profile.py"), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
        capture_output=True, text=True, check=False, cwd=REPO, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for heading in ("## engine passes", "## top ops: update", "## sync debug", "## A/B: update seconds",
                    "## levers: update and log-prob", "## decode step per rollout", "## step table (no Ray)"):
        assert heading in out, heading
    for row in ("| update |", "| log_prob |", "| micro_batch=2 |", "| empty_cache between updates |",
                "| attention eager |", "| hf | 2 |", "| native | 8 |", "| tiny-llama |", "| tiny-qwen2 |"):
        assert row in out, row
    report = json.loads((tmp_path / "gpu_profile_cpu_tiny.json").read_text())
    assert {row["rollout"] for row in report["decode"]} == {"hf", "native"}
    assert [row["batch"] for row in report["decode"]] == [2, 4, 8, 2, 4, 8]
    assert all(row["tokens_per_s"] > 0 and row["step_s"] > 0 for row in report["steps"])
    assert report["engine"]["update"]["wall_s"] > 0
    levers = {(row["precision"], row["adamw"]): row for row in report["levers"]}
    assert set(levers) == {(p, a) for p in ("autocast", "one-rank FSDP2") for a in ("fused", "foreach")}
    assert all(row["update_s"] > 0 and row["log_prob_s"] > 0 for row in levers.values())
