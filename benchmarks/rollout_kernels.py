"""The native rollout's per-step choices, each against its plain alternative, on SmolLM2 shapes (fp32, CPU).

One table, each row a ratio measured in the same run (best of `--repeats` timings of each side):
- decode linear as `(W @ x^T)^T` (`_linear_rows`) vs `F.linear(x, W)`, for the MLP's up projection;
- a decode step on 15 / 63 rows vs 16 / 64 rows (why steps are padded to a multiple of 8 rows);
- inverse-CDF sampling (`sample_from_weights`) vs `torch.multinomial` over the 49k vocabulary.

    python benchmarks/rollout_kernels.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.native.model import _linear_rows
from hybridflow.engines.rollout.native.sampler import sample_from_weights


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def decode_step_time(model, rows: int, context: int, repeats: int) -> float:
    from hybridflow.engines.rollout.native.kv_cache import KVCache
    from hybridflow.engines.rollout.native.model import LlamaFamilyForward

    forward = LlamaFamilyForward(model)
    forward.bind(context + 2)
    cache = KVCache(forward.num_layers, forward.num_kv_heads, forward.head_dim, torch.float32, torch.device("cpu"))
    cache.reserve(rows, context + 2)
    tokens = torch.randint(0, model.config.vocab_size, (rows,))
    lengths = torch.full((rows,), context)
    with torch.inference_mode():
        return best_time(lambda: forward.decode(tokens, lengths, lengths, context + 1, cache), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from hybridflow.models import build_causal_lm, resolve_model_path

    model = build_causal_lm(resolve_model_path(args.model), dtype="float32").eval()
    up = model.model.layers[0].mlp.up_proj.weight  # (1536, 576)
    rows = []
    with torch.inference_mode():
        for batch in (16, 64):
            x = torch.randn(batch, up.shape[1])
            plain = best_time(lambda: F.linear(x, up), args.repeats * 10)
            ours = best_time(lambda: _linear_rows(x, up, None), args.repeats * 10)
            rows.append((f"up_proj {batch} rows: F.linear / (W @ x^T)^T", plain / ours))
        for batch in (16, 64):
            even = decode_step_time(model, batch, 160, args.repeats)
            odd = decode_step_time(model, batch - 1, 160, args.repeats)
            rows.append((f"decode step: {batch - 1} rows / {batch} rows", odd / even))
        logits = torch.randn(64, model.config.vocab_size)
        probs = torch.softmax(logits, dim=-1)
        multinomial = best_time(lambda: torch.multinomial(probs, 1), args.repeats)
        inverse_cdf = best_time(lambda: sample_from_weights(probs.clone()), args.repeats)
        rows.append(("sampling 64 rows: multinomial / inverse CDF", multinomial / inverse_cdf))
    print(f"{args.model} fp32, {args.threads} threads; ratio > 1: the native engine's choice is faster")
    for name, ratio in rows:
        print(f"{name:<48} {ratio:6.2f}x")


if __name__ == "__main__":
    main()
