"""Time one training step and one log-prob pass per parallel layout on this CPU, the collectives a layer moves,
and each rank's peak memory.

Layouts (2 cores in every one): `1 worker` (1 process, 2 torch threads), `dp=2` (FSDP2 over 2 processes),
`tp=2` (DTensor tensor parallel, 2 processes) and `sp=2` (Ulysses, 2 processes), 1 thread per process; and
`1 worker (1 thread)`, which leaves one core idle (what one core does alone, for the cost model's check). Every
layout runs the same global work per step: ROWS x SEQ_LEN tokens for each `--workloads` entry ROWSxSEQ_LEN (the
last half of each row is the response; the defaults hold equal tokens in short and long rows), packed
(`use_remove_padding=True`), one row per micro-batch, fp32, on a
Llama-shaped model built here (`--hidden`, `--layers`, `--heads` 12, `--kv-heads` 4, the tiny local tokenizer's
402-token vocabulary, so that the decoder layers, not the head, hold the FLOPs). dp=2 gives each rank half of the
rows; tp=2 and sp=2 give both ranks all of them. A step is `engine.train_batch` (forward, backward, AdamW); a
log-prob pass is `engine.compute_log_prob`. Each is timed `--repeats` times after a warm-up, as the slowest
rank's wall time, in each of `--rounds` passes over all layouts (so that load from other jobs falls on every
layout); the table shows the median and range over all of them. Peak RSS is each rank's high-water mark during
the timed steps (reset before each through /proc/self/clear_refs), shown with the rank's RSS before the model was
built; saved activations are the bytes autograd keeps for backward in one micro-batch's forward on that rank
(parameters left out). The fp32 matmul rate on 1 and 2 threads is measured at the start of each round.

The collectives are timed on 2 gloo processes (1 thread each) in every round, over a size sweep and at the sizes
one layer moves: a tensor-parallel all-reduce of (seq_len x hidden) fp32, FSDP's all-gather/reduce-scatter of one
layer's parameters, and a Ulysses all-to-all of (seq_len / 2 x hidden). `benchmarks/step_cost_model.py --measured
FILE` fits its constants to what `--out FILE` holds and prints predicted against measured. The 1-minute load
average is recorded with every layout: the machine may be shared.

    python benchmarks/parallel_layouts.py --rounds 3 --out /tmp/parallel_layouts.json   # ~18 minutes, shared cores
    python benchmarks/parallel_layouts.py --layouts "1 worker;tp=2" --workloads 8x256 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_smollm2 import make_batch, nll_loss, timed
from rollout import measure_matmul_flops
from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.env import set_dist_env
from hybridflow.models import build_local_tokenizer, build_tiny_model, save_model_and_tokenizer
from hybridflow.models.config import ModelConfig


@dataclass(frozen=True)
class Layout:
    processes: int
    threads: int
    tp: int = 1
    sp: int = 1


LAYOUTS = {
    "1 worker": Layout(processes=1, threads=2),
    "1 worker (1 thread)": Layout(processes=1, threads=1),
    "dp=2": Layout(processes=2, threads=1),
    "tp=2": Layout(processes=2, threads=1, tp=2),
    "sp=2": Layout(processes=2, threads=1, sp=2),
}
SWEEP_BYTES = tuple(4**k * 1024 for k in range(0, 9))  # 1 KiB .. 64 MiB
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (`VmRSS`) or its high-water mark since the last reset (`VmHWM`), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def reset_peak_rss() -> None:
    """Make VmHWM start again from the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def build_model(path: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> Path:
    """A random Llama-shaped model with an MLP width of 8/3 x hidden (rounded to 128), saved to `path`."""
    intermediate = 128 * round(8 * hidden / 3 / 128)
    model, tokenizer = build_tiny_model(
        num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, intermediate=intermediate,
        max_position_embeddings=4096, tokenizer=build_local_tokenizer(),
    )
    return save_model_and_tokenizer(model, tokenizer, path)


def _barrier_timed(fn, world: int) -> tuple[float, object]:
    """Wall time of `fn()` started together on every rank, as the slowest rank saw it."""
    if world > 1:
        dist.barrier()
    reset_peak_rss()
    seconds, result = timed(fn)
    if world > 1:
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = float(slowest)
    return seconds, result


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage under `tensor` (a DTensor's local shard), None when it has no data:
    DTensor's wrapper and FSDP's freed buffers hold storages without a data pointer."""
    storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
    try:
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # "invalid python storage": nothing allocated behind it
        return None


def measure_saved_activations(engine, micro_batch) -> int:
    """Bytes autograd keeps for backward in one micro-batch's forward on this rank (each storage once; the
    parameters, which autograd also saves, are left out), then a backward so that FSDP's state stays consistent."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        params = {key[0] for key in map(_storage, engine.module.parameters()) if key}
        key = _storage(tensor)
        if key and key[0] not in params:
            storages[key[0]] = key[1]
        return tensor

    engine.module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = engine.forward_micro_batch(micro_batch)
    nll_loss(outputs, micro_batch)[0].backward()
    engine.optimizer.zero_grad(set_to_none=True)
    return sum(storages.values())


def _layout_rank(rank: int, world: int, port: int, layout: Layout, model_dir: str, workloads: list[tuple[int, int]],
                 repeats: int, out_dir: str) -> None:
    torch.set_num_threads(layout.threads)
    set_dist_env(rank, world, local_rank=rank, master_addr="127.0.0.1", master_port=str(port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        base_rss = rss_bytes()
        config = FSDPEngineConfig(
            micro_batch_size_per_gpu=1, model=ModelConfig(use_remove_padding=True), optim=OptimConfig(lr=1e-6),
            fsdp=FSDPConfig(tensor_parallel_size=layout.tp), ulysses_sequence_parallel_size=layout.sp,
        )
        engine = build_fsdp_engine(model_dir, config)
        vocab = engine.module.config.vocab_size
        dp, dp_rank = engine.layout.dp, engine.layout.dp_rank(rank)
        record = {"rank": rank, "base_rss": base_rss, "built_rss": rss_bytes(), "workloads": {}}
        for rows, seq_len in workloads:
            batch = make_batch(vocab, rows, seq_len, seq_len // 2).chunk(dp)[dp_rank]
            engine.train_batch(batch, nll_loss)  # warm-up
            engine.compute_log_prob(batch)
            saved = measure_saved_activations(engine, batch.split(1)[0])
            train, log_prob, train_peak, log_prob_peak = [], [], 0, 0
            for _ in range(repeats):
                seconds, _ = _barrier_timed(lambda: engine.train_batch(batch, nll_loss), world)
                train.append(seconds)
                train_peak = max(train_peak, rss_bytes("VmHWM"))
                seconds, _ = _barrier_timed(lambda: engine.compute_log_prob(batch), world)
                log_prob.append(seconds)
                log_prob_peak = max(log_prob_peak, rss_bytes("VmHWM"))
            record["workloads"][f"{rows}x{seq_len}"] = {
                "train_s": train, "log_prob_s": log_prob, "train_peak_rss": train_peak,
                "log_prob_peak_rss": log_prob_peak, "saved_activations": saved,
                "load": os.getloadavg()[0],
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def _collective(kind: str, num_bytes: int, world: int):
    """A closure running one `kind` collective whose per-rank tensor (all-gather: output) holds `num_bytes`."""
    n = max(world, num_bytes // 4 // world * world)
    full, part = torch.ones(n), torch.ones(n // world)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full)


def _collectives_rank(rank: int, world: int, port: int, sizes: dict[str, list[int]], repeats: int,
                      out_dir: str) -> None:
    torch.set_num_threads(1)
    set_dist_env(rank, world, local_rank=rank, master_addr="127.0.0.1", master_port=str(port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        rows = []
        for kind in COLLECTIVES:
            for num_bytes in sorted(set(sizes[kind])):
                fn = _collective(kind, num_bytes, world)
                fn()
                seconds = [_barrier_timed(fn, world)[0] for _ in range(repeats)]
                rows.append({"kind": kind, "bytes": num_bytes, "seconds": statistics.median(seconds)})
        if rank == 0:
            Path(out_dir, "collectives.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _spawn(fn, nprocs: int, *args) -> None:
    """Run `fn(rank, nprocs, port, *args)` in `nprocs` fresh processes (they join one gloo group)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(fn, args=(nprocs, port, *args), nprocs=nprocs, join=True)


def describe_model(model_dir: Path) -> dict:
    """The sizes the cost model needs, read from the saved model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config)
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    return {"hidden": config.hidden_size, "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "intermediate": config.intermediate_size,
            "vocab": config.vocab_size, "layer_params": layer_params,
            "params": sum(p.numel() for p in model.parameters())}


def layer_sizes(model: dict, seq_len: int) -> dict[str, list[int]]:
    """Bytes one decoder layer moves per collective for a micro-batch of one `seq_len` row (fp32, 2 ranks)."""
    kv_width = model["kv_heads"] * model["hidden"] // model["heads"]
    return {
        "all_reduce": [seq_len * model["hidden"] * 4],  # tensor parallel: after o_proj / down_proj, input grads
        "all_gather": [model["layer_params"] * 4],  # FSDP: one layer's parameters, before forward and backward
        "reduce_scatter": [model["layer_params"] * 4],  # FSDP: one layer's gradients
        "all_to_all": [seq_len // 2 * model["hidden"] * 4, seq_len // 2 * kv_width * 4],  # Ulysses: q/out, k/v
    }


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _merge(previous: list[dict] | None, ranks: list[dict]) -> list[dict]:
    """One record per rank over all rounds: timings appended, peaks the highest, loads the highest."""
    if previous is None:
        return ranks
    for old, new in zip(previous, ranks):
        for name, record in new["workloads"].items():
            merged = old["workloads"][name]
            merged["train_s"] += record["train_s"]
            merged["log_prob_s"] += record["log_prob_s"]
            for key in ("train_peak_rss", "log_prob_peak_rss", "load"):
                merged[key] = max(merged[key], record[key])
    return previous


def print_tables(results: dict) -> None:
    model = results["model"]
    matmul = ", ".join(f"{m['threads']} thread{'s' if m['threads'] > 1 else ''} {m['flops'] / 1e9:.0f}"
                       for m in results["matmul"])
    print(f"\nmodel: hidden {model['hidden']}, {model['layers']} layers, {model['params'] / 1e6:.1f}M parameters "
          f"({model['layer_params'] / 1e6:.2f}M per layer), vocab {model['vocab']}, fp32; run started "
          f"{results['started']}, {os.cpu_count()} cores, {results['rounds']} rounds; fp32 matmul 2048^2 GFLOP/s "
          f"(per round): {matmul}")
    print("| layout | workload (rows x tokens) | train step s, median (range) | train tokens/s | log-prob s, median "
          "(range) | peak RSS per rank in step GiB | RSS before model GiB | saved activations per rank MiB | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, result in results["layouts"].items():
        for workload in results["workloads"]:
            per_rank = [rank["workloads"][workload] for rank in result["ranks"]]
            train, log_prob = per_rank[0]["train_s"], per_rank[0]["log_prob_s"]  # already the slowest rank's
            rows, seq_len = (int(x) for x in workload.split("x"))
            peaks = "/".join(f"{r['train_peak_rss'] / 2**30:.2f}" for r in per_rank)
            base = "/".join(f"{rank['base_rss'] / 2**30:.2f}" for rank in result["ranks"])
            saved = "/".join(f"{r['saved_activations'] / 2**20:.1f}" for r in per_rank)
            loads = result["loads"] + [r["load"] for r in per_rank]
            print(f"| {name} | {workload} | {_median_range(train)} | {rows * seq_len / statistics.median(train):.0f} | "
                  f"{_median_range(log_prob)} | {peaks} | {base} | {saved} | {min(loads):.1f}-{max(loads):.1f} |")
    print("\ncollectives, 2 gloo processes x 1 thread (median of the repeats; bytes = each rank's tensor, the output "
          "for all-gather, the input for reduce-scatter)")
    print("| collective | bytes | ms per round | bytes / ms (GB/s) |")
    print("|---|---|---|---|")
    by_size: dict[tuple[str, int], list[float]] = {}
    for row in results["collectives"]:
        by_size.setdefault((row["kind"], row["bytes"]), []).append(row["seconds"])
    for (kind, num_bytes), seconds in by_size.items():
        print(f"| {kind} | {num_bytes} | {', '.join(f'{t * 1e3:.2f}' for t in seconds)} | "
              f"{num_bytes / statistics.median(seconds) / 1e9:.2f} |")


def measure_matmul(results: dict) -> None:
    """fp32 matmul rate of this machine now, on 1 and 2 threads (the cores may be shared)."""
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results["matmul"].append({"threads": threads, "flops": measure_matmul_flops()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--workloads", default="8x256,2x1024", help="comma-separated ROWSxSEQ_LEN (equal tokens)")
    parser.add_argument("--layouts", default=";".join(LAYOUTS), help="semicolon-separated, from: " + "; ".join(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=2, help="passes over all layouts (spreads outside load)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per workload, layout and round")
    parser.add_argument("--collective-repeats", type=int, default=10)
    parser.add_argument("--out", help="write every measurement as JSON here (for step_cost_model.py --measured)")
    args = parser.parse_args()
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    results = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
               "workloads": args.workloads.split(","), "rounds": args.rounds, "layouts": {}, "collectives": [],
               "matmul": []}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_model(Path(scratch) / "model", args.hidden, args.layers, args.heads, args.kv_heads)
        results["model"] = describe_model(model_dir)
        sizes = {kind: list(SWEEP_BYTES) for kind in COLLECTIVES}
        for _, seq_len in workloads:
            for kind, extra in layer_sizes(results["model"], seq_len).items():
                sizes[kind] += extra
        for round_index in range(args.rounds):
            measure_matmul(results)
            for index, name in enumerate(args.layouts.split(";")):
                layout, out = LAYOUTS[name], Path(scratch) / f"round{round_index}-layout{index}"
                out.mkdir()
                load_before = os.getloadavg()[0]
                _spawn(_layout_rank, layout.processes, layout, str(model_dir), workloads, args.repeats, str(out))
                ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
                entry = results["layouts"].setdefault(name, {"layout": asdict(layout), "ranks": None, "loads": []})
                entry["ranks"] = _merge(entry["ranks"], ranks)
                entry["loads"] += [load_before, os.getloadavg()[0]]
                steps = {w: [round(t, 2) for t in r["train_s"]] for w, r in ranks[0]["workloads"].items()}
                print(f"round {round_index + 1} {name}: train step s {steps}, load {load_before:.1f}-"
                      f"{os.getloadavg()[0]:.1f}", flush=True)
            _spawn(_collectives_rank, 2, sizes, args.collective_repeats, scratch)
            results["collectives"] += json.loads(Path(scratch, "collectives.json").read_text())
            results.setdefault("collectives_load", []).append(os.getloadavg()[0])
    print_tables(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
