"""Over-sampling (rollout.over_sample_rate) on SmolLM2: a training batch's generation time with and without aborting
its stragglers, through the agent-loop manager and the native engine's continuous batching (no Ray).

Each repeat generates one batch of `--prompts` questions x `--n` samples (T=1, up to `--max_tokens` new tokens, eos
ends a response early: lengths vary as in RL) once per rate, the rates interleaved, each from the same seed; reported
per rate: the median wall time, the share of trajectories aborted and the tokens kept (trained on), then each rate's
time over rate 0's.

    python benchmarks/over_sampling.py            # ~4 minutes on 2 idle cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from hybridflow.agents.manager import AgentLoopManager
from hybridflow.engines.rollout import NativeRollout, SamplingParams
from hybridflow.engines.rollout.config import RolloutConfig
from hybridflow.engines.rollout.server import GenerationServer
from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.utils.host import write_results

QUESTIONS = ("What is 17 * 23?", "Name three rivers in Europe.", "Explain what a prime number is.",
             "Write a haiku about rain.", "How do plants make food?", "What is the capital of Peru?",
             "Why is the sky blue?", "Give two uses of a magnet.")


class InProcessReplica:
    """The worker group's server methods over one in-process `GenerationServer` (what a rollout rank runs)."""

    def __init__(self, server: GenerationServer) -> None:
        self.server = server

    def direct_callers(self, name: str, concurrency_group: str | None = None):
        if name == "abort_generation":
            async def abort() -> int:
                return self.server.abort()
            return [abort]
        return [self.server.generate_async]

    def wake_up_rollout_server(self):
        self.server.start()
        return [{"timing_s/update_weights": 0.0}]

    def sleep_rollout_server(self):
        self.server.stop()
        return [{}]


def batch(tokenizer, prompts: int, n: int) -> DataProto:
    raw = np.empty(prompts * n, dtype=object)
    for i in range(prompts * n):
        raw[i] = [{"role": "user", "content": QUESTIONS[(i // n) % len(QUESTIONS)]}]
    return DataProto.from_dict(tensors={"index": torch.arange(prompts * n)}, non_tensors={"raw_prompt": raw})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=192)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.25])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = build_causal_lm(path, dtype="float32").eval()
    rows = args.prompts * args.n
    rollout = NativeRollout(model, tokenizer, SamplingParams(temperature=1.0), max_num_seqs=rows)
    server = GenerationServer(rollout, tokenizer.pad_token_id, max_batch_size=rows, batch_wait_s=0.05,
                              max_model_len=256 + args.max_tokens)
    group = InProcessReplica(server)
    print(f"{args.model} fp32, {args.threads} threads, native engine, continuous batching; {args.prompts} prompts x "
          f"{args.n} samples, up to {args.max_tokens} new tokens at T=1; load avg (1 min) {os.getloadavg()[0]:.2f}")
    results: dict[float, list[dict]] = {rate: [] for rate in args.rates}
    for repeat in range(args.repeats):
        for rate in args.rates:
            config = RolloutConfig(mode="async", temperature=1.0, over_sample_rate=rate, prompt_length=256,
                                   response_length=args.max_tokens)
            manager = AgentLoopManager(group, config, tokenizer, args.max_tokens)
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = manager.generate_sequences(batch(tokenizer, args.prompts, args.n))
            wall = time.perf_counter() - start
            aborted = np.asarray(out.non_tensor_batch["__aborted__"], dtype=bool)
            kept = int(out.batch["response_mask"].sum())
            results[rate].append({"repeat": repeat, "rate": rate, "wall_s": wall, "aborted": float(aborted.mean()),
                                  "tokens_kept": kept, "load": os.getloadavg()[0]})
            print(f"repeat {repeat} rate {rate:<5} wall {wall:6.1f} s, aborted {aborted.mean():5.1%}, "
                  f"tokens kept {kept}", flush=True)
    base = statistics.median(r["wall_s"] for r in results[args.rates[0]])
    print(f"\n{'rate':<6} {'median wall s':>13} {'x rate ' + str(args.rates[0]):>11} {'aborted':>8} {'tokens kept':>11}")
    for rate, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        print(f"{rate:<6} {wall:>13.1f} {wall / base:>11.2f} {statistics.mean(r['aborted'] for r in runs):>8.1%} "
              f"{statistics.mean(r['tokens_kept'] for r in runs):>11.0f}")
    flat = [row for runs in results.values() for row in runs]
    print(f"raw results: {write_results('over_sampling', vars(args), flat, load_before)}")


if __name__ == "__main__":
    main()
