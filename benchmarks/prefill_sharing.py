"""One prefill per distinct prompt against one per row, in the same run: the native rollout on the demo's shape.

The trainer hands the rollout each prompt repeated n times in a row (verl's interleaved layout), and the native
engine prefills each distinct prompt once for all its samples (`interleaved_copies`). The baseline is the same
rows in tiled order (prompt 0..P-1, then again), which the detector does not take as copies, so every row is
prefilled on its own: the engine's path before the change, with the same prompts, samples and work.

Both layouts run alternately (`--repeats` times each, the same seeds), so load on this shared machine hits both
alike. By default eos is ignored, so every row decodes exactly `--new_tokens` tokens and the two layouts do the same
decode work; `--eos` lets responses end as in training. The table gives per layout the median wall seconds of a
`generate_sequences` call, its prefill seconds and prompt tokens prefilled (the batcher's stats), and the ratio
to the per-row baseline. Raw rows go to benchmarks/results/.

    python benchmarks/prefill_sharing.py                     # 8 demo prompts x 8 samples, 32 tokens, ~2 min
    python benchmarks/prefill_sharing.py --prompts 16 --samples 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `benchmarks.rollout`

from benchmarks.rollout import NoEosTokenizer  # noqa: E402
from hybridflow.engines.rollout import ROLLOUTS, SamplingParams  # noqa: E402
from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.utils.host import write_results  # noqa: E402

DEMO_PROMPTS = Path("outputs/demo/data/train.parquet")
FALLBACK_QUESTIONS = ("Calculate 5 - 33.", "Calculate 71 + 74.", "Calculate 49 + 90.", "Calculate 81 - 88.")


def load_messages(num_prompts: int) -> list[list[dict]]:
    """The demo's first `num_prompts` training prompts (chat messages), or arithmetic questions without its data."""
    if DEMO_PROMPTS.is_file():
        rows = pq.read_table(DEMO_PROMPTS, columns=["prompt"]).slice(0, num_prompts).to_pylist()
        if len(rows) == num_prompts:
            return [row["prompt"] for row in rows]
    return [[{"role": "user", "content": FALLBACK_QUESTIONS[i % len(FALLBACK_QUESTIONS)] + f" ({i})"}]
            for i in range(num_prompts)]


def build_rows(tokenizer, messages: list[list[dict]], samples: int, interleaved: bool) -> DataProto:
    """Left-padded prompt rows, each prompt `samples` times: in a row (interleaved) or the whole list repeated."""
    order = ([m for m in messages for _ in range(samples)] if interleaved else messages * samples)
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in order]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                                        "position_ids": position_ids})


def time_call(rollout, rows: DataProto, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = rollout.generate_sequences(rows)
    seconds = time.perf_counter() - start
    stats = rollout.last_stats
    return {"seconds": seconds, "prefill_s": float(stats["prefill_s"]), "prefill_tokens": int(stats["prefill_tokens"]),
            "decode_s": float(stats["decode_s"]), "generated": int(out.batch["response_mask"].sum()),
            "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eos", action="store_true", help="let responses end at eos (default: exactly new_tokens)")
    args = parser.parse_args()
    load_before = list(os.getloadavg())

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = build_causal_lm(path, dtype="float32").eval()
    engine_tokenizer = tokenizer if args.eos else NoEosTokenizer(tokenizer)
    rollout = ROLLOUTS.get("native")(model, engine_tokenizer, SamplingParams(temperature=1.0,
                                                                            max_new_tokens=args.new_tokens))
    messages = load_messages(args.prompts)
    layouts = {"per-row prefill (tiled rows)": build_rows(tokenizer, messages, args.samples, interleaved=False),
               "one prefill per prompt (interleaved rows)": build_rows(tokenizer, messages, args.samples, interleaved=True)}
    rollout.generate_sequences(DataProto.from_dict(  # warm-up: allocations, first-call costs
        tensors={k: v[:2] for k, v in layouts["per-row prefill (tiled rows)"].batch.items()},
        meta_info={"max_new_tokens": 2}))

    rows = []
    for repeat in range(args.repeats):
        for layout, batch in layouts.items():
            rows.append({"layout": layout, "repeat": repeat, **time_call(rollout, batch, seed=repeat)})

    baseline = statistics.median(r["seconds"] for r in rows if r["layout"].startswith("per-row"))
    print(f"{args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens "
          f"({'eos ends responses' if args.eos else 'eos ignored'}), {args.repeats} alternating repeats; "
          f"load before {load_before[0]:.2f}")
    print("| layout | wall s (median) | prefill s | prompt tokens prefilled | generated tokens | vs per-row |")
    print("|---|---|---|---|---|---|")
    for layout in layouts:
        mine = [r for r in rows if r["layout"] == layout]
        seconds = statistics.median(r["seconds"] for r in mine)
        print(f"| {layout} | {seconds:.2f} | {statistics.median(r['prefill_s'] for r in mine):.2f} | "
              f"{mine[0]['prefill_tokens']} | {statistics.median(r['generated'] for r in mine):.0f} | "
              f"{baseline / seconds:.2f}x |")
    print("raw results:", write_results("prefill_sharing", vars(args), rows, load_before), flush=True)


if __name__ == "__main__":
    main()
