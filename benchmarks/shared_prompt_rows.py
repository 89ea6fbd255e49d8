"""Shared-prompt forwards under sdpa: one row per prompt group against one packed row, in the same run.

The training engine's shared-prompt layout (`prefix_sharing`) puts each prompt group in its own forward row, so
sdpa gets one (L x L) mask block per group. Before, every group of a micro-batch sat in one packed row with a
(T x T) mask, whose memory and attention work grow with the square of the micro-batch's tokens. Both forwards are
built here from the same layout (the one-row form keeps the layout's real positions in order, with the mask
`allowed` gives over them, which is what the engine built before), on SmolLM2-135M's architecture with random
weights (fp32), and run alternately. Per micro-batch size the table gives the median seconds of a forward and of a
forward + backward, the dense mask's megabytes, and the largest log-prob difference between the two forms.
`--form` runs one form alone, so that the process's peak resident memory (printed) is that form's.

    python benchmarks/shared_prompt_rows.py                       # 2 and 8 groups of 8 x (96 + 48) tokens, ~3 min
    python benchmarks/shared_prompt_rows.py --groups 4 16 --repeats 3
    python benchmarks/shared_prompt_rows.py --groups 8 --form "one row"    # its peak memory alone
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hybridflow.engines.training.prefix_sharing import build_shared_prompt_layout
from hybridflow.utils.host import write_results

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)


def grouped_rows(groups: int, samples: int, prompt_len: int, response_len: int, seed: int = 0):
    """(ids, mask, pos) of `groups` prompts x `samples` responses, left-padded prompts of 60-100% of `prompt_len`
    tokens and right-padded responses of 50-100% of `response_len`, as the rollout lays them out."""
    rng = np.random.default_rng(seed)
    rows, width = groups * samples, prompt_len + response_len
    ids = rng.integers(3, SMOLLM2_135M["vocab_size"], (rows, width))
    mask = np.zeros((rows, width), dtype=np.int64)
    for group in range(groups):
        prompt = int(rng.integers(prompt_len * 6 // 10, prompt_len + 1))
        block = slice(group * samples, (group + 1) * samples)
        ids[block, :prompt_len] = ids[group * samples, :prompt_len]
        mask[block, prompt_len - prompt : prompt_len] = 1
        for row in range(group * samples, (group + 1) * samples):
            mask[row, prompt_len : prompt_len + int(rng.integers(response_len // 2, response_len + 1))] = 1
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    return ids, mask, pos


def forms(layout):
    """{'per-group rows': inputs, 'one row': inputs} and, per form, the positions predicting response tokens."""
    real = torch.nonzero(layout.segment >= 0).reshape(-1)
    one_row_of = torch.full_like(layout.segment, -1)
    one_row_of[real] = torch.arange(real.numel())
    one_row_mask = layout.allowed(real[:, None], real[None, :])[None, None]
    return {
        "per-group rows": (dict(input_ids=layout.input_ids, position_ids=layout.position_ids,
                                attention_mask=layout.attention_mask()), layout.predictor_of_valid),
        "one row": (dict(input_ids=layout.input_ids.reshape(-1)[real][None],
                         position_ids=layout.position_ids.reshape(-1)[real][None],
                         attention_mask=one_row_mask), one_row_of[layout.predictor_of_valid]),
    }


def token_log_probs(model, inputs, predictors, labels) -> torch.Tensor:
    hidden = model.model(**inputs).last_hidden_state
    logits = model.lm_head(hidden.reshape(-1, hidden.size(-1))[predictors])
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None])[:, 0]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--form", choices=["per-group rows", "one row"], help="run only this form")
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": args.layers}, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    rows = []
    for groups in args.groups:
        ids, mask, pos = grouped_rows(groups, args.samples, args.prompt_len, args.response_len)
        layout = build_shared_prompt_layout(ids, mask, pos, args.response_len)
        labels = torch.from_numpy(ids[:, -args.response_len:]).reshape(-1)[layout.valid_index]
        cases = {name: case for name, case in forms(layout).items() if args.form in (None, name)}
        with torch.no_grad():
            values = {name: token_log_probs(model, inputs, where, labels) for name, (inputs, where) in cases.items()}
        gap = float((values["per-group rows"] - values["one row"]).abs().max()) if len(values) == 2 else float("nan")
        times = {name: {"forward": [], "forward+backward": []} for name in cases}
        for _ in range(args.repeats):
            for name, (inputs, where) in cases.items():
                with torch.no_grad():
                    times[name]["forward"].append(timed(lambda: token_log_probs(model, inputs, where, labels)))
                model.zero_grad(set_to_none=True)
                times[name]["forward+backward"].append(
                    timed(lambda: token_log_probs(model, inputs, where, labels).sum().backward())
                )
        for name, (inputs, _) in cases.items():
            rows.append({
                "groups": groups, "tokens": layout.num_tokens, "form": name,
                "mask_mb": inputs["attention_mask"].numel() / 2**20,
                "forward_s": statistics.median(times[name]["forward"]),
                "forward_backward_s": statistics.median(times[name]["forward+backward"]),
                "max_log_prob_gap": gap,
            })
    print(f"SmolLM2-135M architecture ({args.layers} layers), fp32, sdpa, {args.samples} samples per prompt, "
          f"median of {args.repeats}; load {os.getloadavg()[0]:.1f}")
    print("| groups | tokens | form | mask MB | forward s | fwd+bwd s | fwd+bwd vs one row | max log-prob gap |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next((r for r in rows if r["groups"] == row["groups"] and r["form"] == "one row"), None)
        ratio = f"{row['forward_backward_s'] / base['forward_backward_s']:.2f}x" if base else "-"
        print(f"| {row['groups']} | {row['tokens']} | {row['form']} | {row['mask_mb']:.1f} | {row['forward_s']:.2f} | "
              f"{row['forward_backward_s']:.2f} | {ratio} | {row['max_log_prob_gap']:.1e} |")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory of this process ({args.form or 'both forms'}): {peak_gb:.2f} GB")
    for row in rows:
        row["process_peak_rss_gb"] = peak_gb
    print("raw:", write_results("shared_prompt_rows", vars(args), rows, load_before))


if __name__ == "__main__":
    main()
