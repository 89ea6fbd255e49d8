"""The generation server under an agent-like load on SmolLM2: per-batch vs continuous batching (native engine).

`--conversations` concurrent clients each run `--turns` turns: a request with a random budget of
`--min_tokens`..`--max_tokens` new tokens (sampled at T=1, eos ends a response early), then a random "tool"
pause of 0-`--max_tool_s` seconds, then the response plus a few tool tokens are appended to the prompt for
the next turn. The same seeds drive both modes, so clients ask for the same budgets and pauses in each.
Modes: per-batch, continuous batching, and continuous batching with prefix reuse (a turn continues its
conversation's cached K/V). Reported per mode: wall time, generated tokens/s, mean and 90th-percentile
request latency, the server's mean batch (requests per batch, or sequences per decode step when
continuous) and the share of prompt tokens reused; then each continuous mode over per-batch.

    python benchmarks/generation_server.py                 # ~3 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

import torch

from hybridflow.engines.rollout import NativeRollout, SamplingParams
from hybridflow.engines.rollout.server import GenerationServer
from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.utils.host import write_results

QUESTIONS = ("What is 17 * 23?", "Name three rivers in Europe.", "Explain what a prime number is.",
             "Write a haiku about rain.", "How do plants make food?", "What is the capital of Peru?")


def run_clients(server: GenerationServer, tokenizer, args: argparse.Namespace) -> dict[str, float]:
    latencies: list[float] = []
    generated = [0]
    lock = threading.Lock()

    def client(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        messages = [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        tool_tokens = tokenizer("\n<tool_response>42</tool_response>\n")["input_ids"]
        for turn in range(args.turns):
            budget = rng.randint(args.min_tokens, args.max_tokens)
            start = time.perf_counter()
            out = server.generate(f"c{index}t{turn}", prompt, SamplingParams(max_new_tokens=budget, temperature=1.0))
            with lock:
                latencies.append(time.perf_counter() - start)
                generated[0] += len(out.token_ids)
            prompt = prompt + out.token_ids + tool_tokens
            time.sleep(rng.uniform(0.0, args.max_tool_s))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.conversations)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"wall_s": wall, "tok_s": generated[0] / wall, "tokens": generated[0],
            "latency_mean_s": statistics.mean(latencies), "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--min_tokens", type=int, default=16)
    parser.add_argument("--max_tokens", type=int, default=96)
    parser.add_argument("--max_tool_s", type=float, default=0.3)
    parser.add_argument("--batch_wait_s", type=float, default=0.2, help="per-batch mode's gathering window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = build_causal_lm(path, dtype="float32").eval()
    rollout = NativeRollout(model, tokenizer, SamplingParams(temperature=1.0), max_num_seqs=args.conversations)
    max_model_len = 1024
    print(f"{args.model} fp32, {args.threads} threads, native engine; {args.conversations} conversations x "
          f"{args.turns} turns, {args.min_tokens}-{args.max_tokens} new tokens, tool pauses 0-{args.max_tool_s} s; "
          f"load avg (1 min) {os.getloadavg()[0]:.2f} at start")
    print(f"{'mode':<12} {'wall s':>7} {'tok/s':>7} {'tokens':>7} {'lat mean s':>10} {'lat p90 s':>9} {'mean batch':>10} "
          f"{'reused':>7} {'load':>5}")
    results = {}
    modes = (("per-batch", None, False), ("continuous", max_model_len, False), ("+ reuse", max_model_len, True))
    for mode, length, reuse in modes:
        torch.manual_seed(args.seed)
        server = GenerationServer(rollout, tokenizer.pad_token_id, max_batch_size=args.conversations,
                                  batch_wait_s=args.batch_wait_s, max_model_len=length, prefix_reuse=reuse)
        server.start()
        try:
            server.generate("warm-up", [1, 2, 3], SamplingParams(max_new_tokens=2))
            r = results[mode] = run_clients(server, tokenizer, args)
        finally:
            server.stop()  # a continuous run adds its decode steps to the stats when it ends
        r["mean_batch"] = server.stats()["mean_batch_size"]
        r["reuse"] = server.stats().get("prefix_reuse", 0.0)
        print(f"{mode:<12} {r['wall_s']:>7.1f} {r['tok_s']:>7.1f} {r['tokens']:>7} {r['latency_mean_s']:>10.2f} "
              f"{r['latency_p90_s']:>9.2f} {r['mean_batch']:>10.1f} {r['reuse']:>7.0%} {r['load']:>5.2f}", flush=True)
    base = results["per-batch"]
    for mode in ("continuous", "+ reuse"):
        ratio = results[mode]["tok_s"] / base["tok_s"]
        latency = base["latency_mean_s"] / results[mode]["latency_mean_s"]
        print(f"{mode} / per-batch: {ratio:.2f}x tokens/s, {latency:.2f}x lower mean latency")
    rows = [{"mode": mode, **result} for mode, result in results.items()]
    print(f"raw results: {write_results('generation_server', vars(args), rows, load_before)}")


if __name__ == "__main__":
    main()
