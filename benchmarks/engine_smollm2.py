"""Time the training engine and the hf rollout hand-over on SmolLM2-135M-Instruct (fp32, one process).

Measures, for `--batch` sequences of `--seq-len` tokens (the last `--response-len` are the response):
one train step (forward + backward over micro-batches + AdamW), one log-prob pass, one full-parameter
gather + `update_weights` into an hf rollout, and the peak RSS. Prints a table; the 1-minute load average
is shown because the machine may be shared.

    python benchmarks/engine_smollm2.py --micro-batch 4
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.utils.host import write_results


def make_batch(vocab_size: int, batch: int, seq_len: int, response_len: int) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    mask = torch.ones_like(ids)
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": torch.arange(seq_len).expand(batch, -1).clone(),
        "responses": ids[:, -response_len:],
        "response_mask": mask[:, -response_len:],
    }
    return DataProto.from_dict(tensors=tensors)


def nll_loss(outputs, micro_batch):
    mask = micro_batch.batch["response_mask"].float()
    loss = (-(outputs["log_probs"] * mask).sum(-1) / mask.sum(-1)).mean()
    return loss, {}


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    load_before = list(os.getloadavg())

    rows: list[tuple[str, str]] = [
        ("torch threads", str(torch.get_num_threads())),
        ("load avg (1 min) at start", f"{os.getloadavg()[0]:.2f}"),
    ]
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    config = FSDPEngineConfig(
        micro_batch_size_per_gpu=args.micro_batch, fsdp=FSDPConfig(dtype="float32"), optim=OptimConfig(lr=1e-6)
    )
    seconds, engine = timed(lambda: build_fsdp_engine(path, config, tokenizer=tokenizer))
    rows.append(("build engine (load fp32)", f"{seconds:.1f} s"))
    batch = make_batch(len(tokenizer), args.batch, args.seq_len, args.response_len)
    tokens = args.batch * args.seq_len
    for step in range(args.steps):
        seconds, metrics = timed(lambda: engine.train_batch(batch, nll_loss))
        name = f"train step {step} (fwd+bwd+AdamW, mb {args.micro_batch})"
        rows.append((name, f"{seconds:.1f} s ({tokens / seconds:.0f} tok/s)"))
    seconds, _ = timed(lambda: engine.compute_log_prob(batch, temperature=1.0))
    rows.append((f"log-prob pass (mb {args.micro_batch})", f"{seconds:.1f} s ({tokens / seconds:.0f} tok/s)"))
    seconds, _ = timed(lambda: engine.compute_log_prob(batch, temperature=1.0, calculate_entropy=True))
    rows.append(("log-prob + entropy pass", f"{seconds:.1f} s"))

    seconds, rollout = timed(lambda: HFRollout(path, tokenizer, SamplingParams(max_new_tokens=args.response_len)))
    rows.append(("build hf rollout (own copy)", f"{seconds:.1f} s"))
    seconds, _ = timed(lambda: rollout.update_weights(engine.named_full_params()))
    rows.append(("gather full params + update_weights", f"{seconds:.2f} s"))
    rows.append(("peak RSS", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"))
    rows.append(("load avg (1 min) at end", f"{os.getloadavg()[0]:.2f}"))

    width = max(len(name) for name, _ in rows)
    print(f"SmolLM2-135M fp32, {args.batch} x {args.seq_len} tokens (response {args.response_len})")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    path = write_results("engine_smollm2", vars(args), [{"measure": n, "value": v} for n, v in rows], load_before)
    print(f"raw results: {path}")


if __name__ == "__main__":
    main()
