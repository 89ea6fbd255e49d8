"""A bundle that runs the GPU tests, `gpu_profile.py` and `gpu_smoke.py` on an offline CUDA node whose image has torch and
transformers but not the rest (Ray, hydra, tensordict...), in under 64 MiB: wheels for the node's Python, Ray's
wheel without its Java jars and the libraries hybridflow never imports (rllib, serve, tune, data, llm, the
dashboard's web client), the SmolLM2 tokenizer, model configs for random-weight stand-ins (SmolLM2-135M's
architecture and a 1.46B llama), and `run.sh`, which installs the wheels into /tmp/site and runs everything with
per-phase time limits, writing logs and per-setting metrics into $OUT (default ./gpu_out).

    python benchmarks/offline_gpu_bundle.py --out .gpu_bundle        # here, with network access to PyPI
    bash .gpu_bundle/run.sh                                           # there, from the repository root

This is how the 2026-11-26 H200 figures in docs/performance.md were taken.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Pure-Python or cp-tagged wheels a CUDA image with torch, transformers, peft, pyarrow, pandas and the
# aiohttp stack typically lacks; versions are this project's pins where it has them.
WHEELS = [
    "ray==2.60.0", "tensordict==0.15.3", "omegaconf==2.3.1", "hydra-core==1.3.8", "gguf==0.19.0",
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "pyvers>=0.2,<0.3",
]
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]  # omegaconf's parser runtime ships no wheel
RAY_UNUSED = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/tune/", "ray/llm/",
              "ray/dashboard/client/build/")
LLAMA_1B = {  # SmolLM2's config scaled to 1.46B parameters (same tokenizer and vocabulary)
    "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "num_hidden_layers": 20, "tie_word_embeddings": False,
}


def strip_wheel(wheel: Path, drop: tuple[str, ...]) -> None:
    """Rewrite `wheel` without the files under `drop` (and without their RECORD rows), in place."""
    stripped = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in source.infolist():
            if info.filename.startswith(drop):
                continue
            data = source.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [row for row in csv.reader(io.StringIO(data.decode())) if row and not row[0].startswith(drop)]
                text = io.StringIO()
                csv.writer(text, lineterminator="\n").writerows(rows)
                data = text.getvalue().encode()
            entry = zipfile.ZipInfo(info.filename, info.date_time)
            entry.external_attr = info.external_attr
            entry.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(entry, data)
    stripped.replace(wheel)


def download_wheels(target: Path, python_version: str) -> None:
    tag = python_version.replace(".", "")
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                               "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", f"--python-version={tag}",
                    "--implementation=cp", *platforms, "-d", str(target), *WHEELS], check=True)
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(target), *SDIST_ONLY], check=True)
    for wheel in target.glob("ray-*.whl"):
        strip_wheel(wheel, RAY_UNUSED)


def write_model_configs(target: Path) -> None:
    """`cache/tokenizers/smollm2-135m-instruct` (the tokenizer, converted from the catalogue's GGUF, where the
    tests look for it) and `arch/{smollm2,llama1b}/config.json` (run.sh copies the tokenizer beside them)."""
    from hybridflow.models import resolve_model_path
    from hybridflow.models.catalogue import catalogue_tokenizer_path

    tokenizers = target / "cache" / "tokenizers" / "smollm2-135m-instruct"
    tokenizers.mkdir(parents=True, exist_ok=True)
    for file in catalogue_tokenizer_path("smollm2-135m-instruct").iterdir():
        if file.is_file() and file.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(file, tokenizers / file.name)
    config = json.loads((Path(resolve_model_path("smollm2-135m-instruct")) / "config.json").read_text())
    for name, changes in (("smollm2", {}), ("llama1b", LLAMA_1B)):
        directory = target / "arch" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({**config, **changes}, indent=2))


RUN_SH = r"""#!/usr/bin/env bash
# Run from the repository root on the GPU node: installs the bundle's wheels into /tmp/site, then the gpu tests,
# gpu_profile.py and gpu_smoke.py (random-weight stand-ins), each phase under a time limit (RUN_TESTS=0 or
# RUN_PROFILE=0 skips a phase). Logs and metrics go to $OUT.
set -u
B=$(cd "$(dirname "$0")" && pwd); OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$B"/wheels/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled HYBRIDFLOW_CACHE=$B/cache
for model in "$B"/arch/*/; do cp "$B"/cache/tokenizers/smollm2-135m-instruct/* "$model"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,transformers,ray; print('torch',torch.__version__,'transformers',transformers.__version__,'ray',ray.__version__)"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  el tests  # at the limit xdist may lose its summary (seen on the H100): each failure is in test_failures.log already
  HYBRIDFLOW_TEST_FAILURE_LOG=$OUT/test_failures.log timeout -s INT -k 20 ${TESTS_S:-240} python3 -m pytest -m gpu -p no:cacheprovider -v --timeout ${TEST_TIMEOUT_S:-150} -n ${NPROC:-4} -rfEs --tb=short \
    ${TESTS:-tests/gpu tests/engines/test_gpu.py tests/engines/training/test_parallel_training.py tests/engines/rollout/native/test_tensor_parallel.py tests/algorithms/test_device.py tests/engines/training/test_host_syncs.py tests/engines/training/test_attention_masks.py} \
    > "$OUT/tests.log" 2>&1; echo "tests rc $?"; grep -E "passed|failed" "$OUT/tests.log" | tail -2
fi
if [ "${RUN_PROFILE:-1}" = 1 ]; then
  el gpu_profile  # no Ray; raw JSON into benchmarks/results/, tables into the log
  timeout ${PROFILE_S:-600} python3 benchmarks/gpu_profile.py ${PROFILE_ARGS:-} > "$OUT/gpu_profile.log" 2>&1
  echo "gpu_profile rc $?"; grep -E "^#|^\|" "$OUT/gpu_profile.log"; cp benchmarks/results/gpu_profile_*.json "$OUT"/ 2>/dev/null
fi
for model in ${MODELS:-smollm2 llama1b}; do
  el "smoke $model"
  timeout ${SMOKE_S:-300} python3 benchmarks/gpu_smoke.py --steps ${STEPS:-4} --timeout ${SETTING_S:-120} \
    --model "$B/arch/$model" --random-init --reward-fn benchmarks/answer_match_reward.py \
    --save-metrics "$OUT" ${ONLY:+--only "$ONLY"} > "$OUT/smoke_$model.log" 2>&1
  echo "smoke $model rc $?"; grep -E "^\||random-init" "$OUT/smoke_$model.log"
done
el done
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu_bundle")
    parser.add_argument("--python-version", default="3.12", help="the GPU node's Python (its wheels' tag)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    download_wheels(args.out / "wheels", args.python_version)
    write_model_configs(args.out)
    (args.out / "run.sh").write_text(RUN_SH)
    (args.out / "run.sh").chmod(0o755)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"bundle {args.out}: {size / 2**20:.1f} MiB; on the node: bash {args.out.name}/run.sh (from the repo root)")


if __name__ == "__main__":
    main()
