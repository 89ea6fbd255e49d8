"""The native rollout's per-step choices, each against its plain alternative, on SmolLM2 shapes (fp32, CPU).

One table, each row a ratio measured in the same run (best of `--repeats` timings of each side):
- the compiled CPU kernels (`native/csrc/decode_kernels.cpp`) against the torch ops they replace:
  all 211 weight products of a decode step (every weight read from memory, as in a real step), the
  attention of all 30 layers over the cache, and a whole decode step (`LlamaFamilyForward.decode`);
- the torch path's choices: decode linear as `(W @ x^T)^T` (`_linear_rows`) vs `F.linear(x, W)`; a
  decode step on 15 / 63 rows vs 16 / 64 rows (why torch-op steps are padded to a multiple of 8 rows, and
  why kernel steps are not);
  inverse-CDF sampling (`sample_from_weights`) vs `torch.multinomial` over the 49k vocabulary.

    python benchmarks/rollout_kernels.py
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.native.kernels import load_cpu_kernels
from hybridflow.engines.rollout.native.model import _linear_rows
from hybridflow.engines.rollout.native.sampler import sample_from_weights
from hybridflow.utils.host import write_results


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def decode_step_time(model, rows: int, context: int, repeats: int, kernels=None) -> float:
    from hybridflow.engines.rollout.native.kv_cache import KVCache
    from hybridflow.engines.rollout.native.model import LlamaFamilyForward

    forward = LlamaFamilyForward(model, kernels)
    forward.bind(context + 2)
    cache = KVCache(forward.num_layers, forward.num_kv_heads, forward.head_dim, torch.float32, torch.device("cpu"))
    cache.reserve(rows, context + 2)
    tokens = torch.randint(0, model.config.vocab_size, (rows,))
    lengths = torch.full((rows,), context)
    with torch.inference_mode():
        return best_time(lambda: forward.decode(tokens, lengths, lengths, context + 1, cache), repeats)


def attention_times(model, kernels, slots: int, context: int, repeats: int) -> tuple[float, float]:
    """Seconds for the attention of every layer over `context` cached positions: torch ops, kernel."""
    from hybridflow.engines.rollout.native.model import _decode_attention

    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    group, layers, max_len = config.num_attention_heads // kv_heads, config.num_hidden_layers, context + 64
    queries = [torch.randn(slots, kv_heads, group, head_dim) * head_dim**-0.5 for _ in range(layers)]
    caches = [(torch.randn(slots, kv_heads, max_len, head_dim), torch.randn(slots, kv_heads, max_len, head_dim))
              for _ in range(layers)]  # one cache per layer: read from memory, as in a step
    bias = torch.zeros(slots, 1, 1, context)
    visible = torch.full((slots,), context)
    plain = best_time(
        lambda: [_decode_attention(q, k[:, :, :context], v[:, :, :context], bias) for q, (k, v) in zip(queries, caches)],
        repeats,
    )
    ours = best_time(lambda: [kernels.decode_attention(q, k, v, visible) for q, (k, v) in zip(queries, caches)], repeats)
    return plain, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    torch.set_num_threads(args.threads)
    from hybridflow.models import build_causal_lm, resolve_model_path

    model = build_causal_lm(resolve_model_path(args.model), dtype="float32").eval()
    kernels = load_cpu_kernels("cpu")
    up = model.model.layers[0].mlp.up_proj.weight  # (1536, 576)
    rows = []
    with torch.inference_mode():
        weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name]
        weights.append(model.lm_head.weight)
        packed = [kernels.pack_weight(w) for w in weights]
        for batch in (16, 64):
            inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
            plain = best_time(lambda: [_linear_rows(inputs[w.shape[1]], w, None) for w in weights], args.repeats)
            ours = best_time(
                lambda: [kernels.linear_rows(inputs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, packed)],
                args.repeats,
            )
            rows.append((f"{len(weights)} weight products, {batch} rows: torch / kernel", plain / ours))
        for batch, context in ((16, 100), (64, 170)):
            plain, ours = attention_times(model, kernels, batch, context, args.repeats)
            rows.append((f"attention, {batch} slots x {context} positions: torch / kernel", plain / ours))
        for batch, context in ((16, 100), (64, 170)):
            plain = decode_step_time(model, batch, context, args.repeats)
            ours = decode_step_time(model, batch, context, args.repeats, kernels)
            rows.append((f"decode step, {batch} rows: torch ops / kernels", plain / ours))
        for batch in (16, 64):
            x = torch.randn(batch, up.shape[1])
            plain = best_time(lambda: F.linear(x, up), args.repeats * 10)
            ours = best_time(lambda: _linear_rows(x, up, None), args.repeats * 10)
            rows.append((f"up_proj {batch} rows: F.linear / (W @ x^T)^T", plain / ours))
        for batch in (16, 64):
            even = decode_step_time(model, batch, 160, args.repeats)
            odd = decode_step_time(model, batch - 1, 160, args.repeats)
            rows.append((f"decode step: {batch - 1} rows / {batch} rows", odd / even))
        for batch in (16, 64):  # with the kernels: why steps are not padded
            even = decode_step_time(model, batch, 160, args.repeats, kernels)
            odd = decode_step_time(model, batch - 1, 160, args.repeats, kernels)
            rows.append((f"decode step, kernels: {batch - 1} rows / {batch} rows", odd / even))
        logits = torch.randn(64, model.config.vocab_size)
        probs = torch.softmax(logits, dim=-1)
        multinomial = best_time(lambda: torch.multinomial(probs, 1), args.repeats)
        inverse_cdf = best_time(lambda: sample_from_weights(probs.clone()), args.repeats)
        rows.append(("sampling 64 rows: multinomial / inverse CDF", multinomial / inverse_cdf))
    print(f"{args.model} fp32, {args.threads} threads; ratio > 1: the native engine's choice is faster")
    for name, ratio in rows:
        print(f"{name:<56} {ratio:6.2f}x")
    path = write_results("rollout_kernels", vars(args), [{"measure": n, "ratio": r} for n, r in rows], load_before)
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
