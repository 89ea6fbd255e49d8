#!/usr/bin/env bash
# On a GPU node: every gpu-marked test (1 GPU and, where present, 2+), then GRPO on SmolLM2 per setting with a
# table of step time, tokens/s, MFU and peak memory. Run from the repository root after `make .venv/.installed-stamp`.
# Arguments go to gpu_smoke.py; on an offline node without SmolLM2's weights or reasoning-gym, for example:
#   bash benchmarks/gpu_smoke.sh --model DIR_WITH_CONFIG_AND_TOKENIZER --random-init --reward-fn benchmarks/answer_match_reward.py
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export RAY_AUTH_MODE=disabled
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.device_count(), 'GPU(s):', torch.cuda.get_device_name(0))" || exit 2
"$PY" -m pytest -m gpu -p no:cacheprovider -q tests/gpu tests/engines/test_gpu.py tests/engines/training/test_parallel_training.py \
  tests/engines/rollout/native/test_tensor_parallel.py tests/algorithms/test_device.py tests/engines/training/test_host_syncs.py
tests_rc=$?
"$PY" benchmarks/gpu_smoke.py --steps "${STEPS:-4}" "$@"
bench_rc=$?
echo "gpu tests exit ${tests_rc}, benchmark exit ${bench_rc}"
exit $(( tests_rc != 0 || bench_rc != 0 ))
