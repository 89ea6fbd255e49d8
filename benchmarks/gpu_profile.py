"""Where a GPU step's time goes, in one process without Ray: training engine, rollouts' decode step, step table.

Sections (each prints a table and lands in the JSON written to `benchmarks/results/`):
- `engine`: the training engine's update (`train_batch`) and log-prob (`compute_log_prob`) passes under
  `torch.profiler`: wall time against summed kernel time (GPU busy %), counts of stream synchronisations, memcpys
  and mallocs, and the top ops by self device time (CPU time on CPU);
- `sync_debug`: `torch.cuda.set_sync_debug_mode("warn")` around one update's micro-batch loop, counting the
  synchronising calls it reports (CUDA only);
- `ab`: update seconds for micro-batch sizes, with and without `empty_cache()` between updates, and sdpa against
  eager attention;
- `levers`: the update and log-prob passes of the `engine` shape under each of autocast over unsharded float32
  weights (the default for one rank) and FSDP2's mixed precision over a one-rank group (`join_single_rank_group`),
  each with AdamW's fused kernel (the default) and its foreach kernels: best-of-3 wall seconds, MFU, and one
  profiled update's memcpy and launch counts, all in one process, so the variants share a card and a run;
- `decode`: one decode step of each rollout (hf, native) at three batch sizes: kernel launches (CUDA graph launches
  counted as one) and GPU busy % per step, tokens/s, and the bandwidth floor (weights plus the KV cache at the mean
  context read once per step over the measured device bandwidth);
- `steps`: generation, log-prob and update of one GPU-sized batch (the trainer's stages without Ray) for 0.5B and
  1.5B llama- and qwen2-shaped models with random weights.

    python benchmarks/gpu_profile.py                    # one GPU, under 10 minutes
    python benchmarks/gpu_profile.py --device cpu --tiny  # the same tables on tiny models, in seconds

Weights are random (an offline node has no checkpoints) and use the SmolLM2 tokenizer's vocabulary where a
checkpoint would; timings do not depend on the values.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hybridflow.engines.rollout import ROLLOUTS, SamplingParams
from hybridflow.engines.rollout.base import compute_rollout_copy_dtype
from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.sharding import join_single_rank_group
from hybridflow.models.config import ModelConfig
from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_torch_device

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # random-init stand-ins: Qwen2-0.5B/1.5B and llama of the same sizes with SmolLM2's vocabulary
    "qwen2-0.5b": (Qwen2Config, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                     tie_word_embeddings=True)),
    "qwen2-1.5b": (Qwen2Config, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                     tie_word_embeddings=True)),
    "llama-0.5b": (LlamaConfig, dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                     num_attention_heads=16, num_key_value_heads=8, vocab_size=49152,
                                     tie_word_embeddings=True)),
    "llama-1.5b": (LlamaConfig, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=20,
                                     num_attention_heads=16, num_key_value_heads=8, vocab_size=49152,
                                     tie_word_embeddings=False)),
}
TINY = {"tiny-llama": (LlamaConfig, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512)),
        "tiny-qwen2": (Qwen2Config, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512))}
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of every section: the GPU plan, or a tiny one that runs on CPU in seconds."""

    engine_model: str
    batch: int
    prompt_len: int
    response_len: int
    micro_batches: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_tokens: int
    step_models: tuple[str, ...]
    step_prompts: int
    step_n: int
    step_token_budget: int
    """Tokens per micro-batch of the step rows' passes (verl's use_dynamic_bsz budget)."""
    step_attention: tuple[str, ...] = ("sdpa",)
    """Attention kernels of the step rows, one row per model and kernel: sdpa takes the packed rows' dense
    (tokens x tokens) mask and computes every block of it; flex_attention a block mask that skips the blocks
    between sequences (at a 16k-token budget, most of them)."""


GPU_PLAN = Plan("qwen2-0.5b", 64, 256, 512, (4, 16, 32), (8, 64, 256), 64,
                ("llama-0.5b", "qwen2-0.5b", "llama-1.5b", "qwen2-1.5b"), 32, 8, 16384)
TINY_PLAN = Plan("tiny-llama", 8, 8, 8, (2, 8), (2, 4, 8), 4, ("tiny-llama", "tiny-qwen2"), 2, 2, 16)


def peak_flops() -> float:
    """The MFU denominator: GPU_PEAK_TFLOPS, default 989 (dense bf16 of an H100 or H200 SXM)."""
    return float(os.environ.get("GPU_PEAK_TFLOPS", "989")) * 1e12


def synchronize() -> None:
    torch.accelerator.synchronize() if torch.accelerator.is_available() else None


def release_memory() -> None:
    gc.collect()
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


def timed(fn):
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return result, time.perf_counter() - start


def save_model(name: str, directory: Path, tokenizer) -> str:
    """A random-weight checkpoint of shape `name` (fp32) with the tokenizer, once per run."""
    target = directory / name
    if not target.exists():
        config_cls, sizes = {**SHAPES, **TINY}[name]
        config = config_cls(**sizes, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        # initialised on the accelerator: on the host a 1.5B model's random init takes about a minute of the
        # profile's few minutes
        with get_torch_device():
            model = AutoModelForCausalLM.from_config(config)
        save_model_and_tokenizer(model, tokenizer, target)
        del model
        release_memory()
    return str(target)


def random_batch(vocab: int, rows: int, prompt_len: int, response_len: int) -> DataProto:
    """Full-length prompt+response rows of random tokens (no padding: the work is exactly rows x length)."""
    ids = torch.randint(3, vocab, (rows, prompt_len + response_len))
    mask = torch.ones_like(ids)
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
               "responses": ids[:, prompt_len:], "response_mask": mask[:, prompt_len:]}
    return DataProto.from_dict(tensors=tensors)


def nll_loss(outputs, micro_batch):
    mask = micro_batch.batch["response_mask"].to(outputs["log_probs"].dtype)
    loss = -(outputs["log_probs"] * mask).sum() / mask.sum()
    return loss, {}


def summarize_profile(prof, wall_s: float, on_cuda: bool, steps: int = 1, top: int = 8) -> dict:
    """Wall vs summed kernel time, host-sync / memcpy / malloc / launch counts and the top ops of a profile."""
    names = Counter(event.name for event in prof.events())
    averages = prof.key_averages()
    if on_cuda:
        busy_s = sum(a.self_device_time_total for a in averages if a.device_type.name == "CUDA") / 1e6
        ranked = sorted(averages, key=lambda a: a.self_device_time_total, reverse=True)
        top_ops = [(a.key[:60], a.self_device_time_total / 1e3, a.count) for a in ranked[:top]]
    else:
        busy_s = float("nan")
        ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
        top_ops = [(a.key[:60], a.self_cpu_time_total / 1e3, a.count) for a in ranked[:top]]
    host_ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
    memcpy_kinds = Counter({n: c for n, c in names.items() if n.startswith(("cudaMemcpy", "Memcpy", "Memset"))})
    return {
        "top_host_ops_ms": [(a.key[:60], a.self_cpu_time_total / 1e3, a.count) for a in host_ranked[:top]],
        "memcpy_kinds": {n: c / steps for n, c in memcpy_kinds.most_common(8)},
        "wall_s": wall_s, "kernel_s": busy_s, "gpu_busy_pct": 100 * busy_s / wall_s if on_cuda else float("nan"),
        "syncs": sum(names[n] for n in SYNC_NAMES) / steps,
        "memcpys": sum(c for n, c in names.items() if n.startswith(("cudaMemcpy", "Memcpy"))) / steps,
        "mallocs": names["cudaMalloc"] / steps, "launches": sum(names[n] for n in LAUNCH_NAMES) / steps,
        "top_ops_ms": top_ops,
    }


def profiled(fn, on_cuda: bool, steps: int = 1) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        _, wall = timed(fn)
    return summarize_profile(prof, wall, on_cuda, steps)


def engine_config(plan: Plan, micro: int, attn: str = "sdpa") -> FSDPEngineConfig:
    return FSDPEngineConfig(micro_batch_size_per_gpu=micro, optim=OptimConfig(lr=1e-6),
                            model=ModelConfig(override_config={"attn_implementation": attn}))


def section_engine(plan: Plan, path: str, vocab: int, on_cuda: bool) -> dict:
    engine = build_fsdp_engine(path, engine_config(plan, plan.micro_batches[-1]))
    batch = random_batch(vocab, plan.batch, plan.prompt_len, plan.response_len)
    engine.train_batch(batch, nll_loss)  # warm-up: allocator, kernels, optimizer state
    engine.compute_log_prob(batch)  # and the no-grad pass's own first call (the 2026-11-27 H100 run had none)
    result = {"update": profiled(lambda: engine.train_batch(batch, nll_loss), on_cuda),
              "log_prob": profiled(lambda: engine.compute_log_prob(batch), on_cuda)}
    if on_cuda:  # every synchronising call inside one update's micro-batch loop
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.train_batch(batch, nll_loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result["sync_debug"] = Counter(str(w.message).splitlines()[0][:80] for w in caught).most_common(10)
    else:
        result["sync_debug"] = "n/a (CUDA only)"
    return result


def section_ab(plan: Plan, path: str, vocab: int) -> dict:
    """Update seconds (best of 2 after a warm-up) per micro-batch size, empty_cache between updates, attention."""
    batch = random_batch(vocab, plan.batch, plan.prompt_len, plan.response_len)
    variants = [(f"micro_batch={m}", engine_config(plan, m), False) for m in plan.micro_batches]
    variants += [("empty_cache between updates", engine_config(plan, plan.micro_batches[-1]), True),
                 ("attention eager", engine_config(plan, plan.micro_batches[-1], "eager"), False)]
    rows = {}
    for name, config, empty in variants:
        engine = build_fsdp_engine(path, config)
        times = []
        for _ in range(3):
            if empty and torch.accelerator.is_available():
                torch.accelerator.empty_cache()
            times.append(timed(lambda: engine.train_batch(batch, nll_loss))[1])
        rows[name] = min(times[1:])
        del engine
    return rows


LEVERS = (("autocast", False, True), ("autocast", False, False),
          ("one-rank FSDP2", True, True), ("one-rank FSDP2", True, False))  # (precision, own group, fused AdamW)


def section_levers(plan: Plan, path: str, vocab: int, on_cuda: bool) -> list[dict]:
    """The engine shape's update and log-prob passes per (precision path, AdamW kernel); see the module's doc."""
    batch = random_batch(vocab, plan.batch, plan.prompt_len, plan.response_len)
    tokens = plan.batch * (plan.prompt_len + plan.response_len)
    peak = peak_flops() if on_cuda else float("nan")
    rows = []
    for precision, own_group, fused in LEVERS:
        config = dataclasses.replace(engine_config(plan, plan.micro_batches[-1]), fsdp=FSDPConfig(dtype="bfloat16"),
                                     optim=OptimConfig(lr=1e-6, override_optimizer_config={"fused": fused, "foreach": not fused}))
        joined = own_group and join_single_rank_group(config, get_torch_device(0) if on_cuda else torch.device("cpu"))
        if own_group and not joined:
            raise RuntimeError("a process group already exists: the one-rank variants need to make their own")
        try:
            engine = build_fsdp_engine(path, config)
            params = sum(p.numel() for p in engine.module.parameters())
            engine.train_batch(batch, nll_loss)
            engine.compute_log_prob(batch)
            update_s = min(timed(lambda: engine.train_batch(batch, nll_loss))[1] for _ in range(3))
            log_prob_s = min(timed(lambda: engine.compute_log_prob(batch))[1] for _ in range(3))
            summary = profiled(lambda: engine.train_batch(batch, nll_loss), on_cuda)
            rows.append({"precision": precision, "adamw": "fused" if fused else "foreach", "update_s": update_s,
                         "update_mfu_pct": 100 * 6 * params * tokens / update_s / peak,
                         "log_prob_s": log_prob_s, "log_prob_mfu_pct": 100 * 2 * params * tokens / log_prob_s / peak,
                         "memcpys": summary["memcpys"], "launches": summary["launches"],
                         "gpu_busy_pct": summary["gpu_busy_pct"]})
            del engine
        finally:
            if joined:
                dist.destroy_process_group()
            release_memory()
    return rows


def measure_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes read per second by a reduction over a large tensor on `device` (best of 3)."""
    src = torch.ones(num_bytes // 4, device=device)
    return num_bytes / min(timed(src.sum)[1] for _ in range(3))


def section_decode(plan: Plan, path: str, tokenizer, device: torch.device, on_cuda: bool,
                   ops: dict | None = None) -> list[dict]:
    """Per rollout and batch: a generation of `decode_tokens` tokens after a warm-up; per-step numbers divide the
    profile of the whole call by its decode steps (prefill included, so an upper bound on launches). `ops` receives,
    per rollout, the top device and host ops of the call at the middle batch size (where a step's time goes)."""
    bandwidth = measure_bandwidth(device, 2**30 if on_cuda else 2**26)
    rows = []
    # native+compile (GPU only; on CPU inductor's compile would add half a minute to the tiny run): the decode step
    # through torch.compile before its graphs are captured (fewer, fused kernels per step and fewer nodes per graph
    # launch), the A/B that decides whether it becomes the default. Its CPU check is a slow test of
    # tests/engines/rollout/native/test_decode_graph.py.
    variants = {"hf": {}, "native": {}}
    if on_cuda:
        variants["native+compile"] = {"kernels": "torch", "compile_decode": True}
    for label, extra in variants.items():
        name = label.split("+")[0]
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype="auto")
        dtype = torch.bfloat16 if on_cuda else torch.float32
        slots = {"max_num_seqs": max(plan.decode_batches), **extra} if name == "native" else {}
        params = SamplingParams(temperature=1.0, max_new_tokens=plan.decode_tokens)
        rollout = ROLLOUTS.get(name)(model.to(device, dtype), tokenizer, params, **slots)
        config = model.config
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
        for batch in plan.decode_batches:
            prompts = random_batch(config.vocab_size, batch, 32, 0)
            prompts = DataProto.from_dict(tensors={k: prompts.batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
            rollout.generate_sequences(prompts)  # warm-up (and graph capture)
            out, seconds = timed(lambda: rollout.generate_sequences(prompts))
            tokens = int(out.batch["response_mask"].sum())
            steps = max(plan.decode_tokens - 1, 1)
            summary = profiled(lambda: rollout.generate_sequences(prompts), on_cuda, steps)
            context = 32 + plan.decode_tokens / 2
            floor_s = (weight_bytes + batch * context * kv_per_token) / bandwidth
            rows.append({"rollout": label, "batch": batch, "tok_s": tokens / seconds, "step_ms": 1e3 * seconds / steps,
                         "floor_step_ms": 1e3 * floor_s, "x_floor": seconds / steps / floor_s,
                         "launches_per_step": summary["launches"], "syncs_per_step": summary["syncs"],
                         "gpu_busy_pct": summary["gpu_busy_pct"]})
            if ops is not None and batch == plan.decode_batches[len(plan.decode_batches) // 2]:
                ops[f"{label}, batch {batch}"] = {key: summary[key] for key in ("top_ops_ms", "top_host_ops_ms")}
        del rollout, model
    return rows


def _step_row(plan: Plan, name: str, path: str, tokenizer, device: torch.device, on_cuda: bool,
              attention: str = "sdpa") -> dict:
    """One model's row of the step table: the demo's engine settings (packed rows, fused vocabulary head) with
    micro-batches of about `plan.step_token_budget` tokens. (The 2026-11-27 H200 run sent the 1.46B llama 32 padded
    rows of 768 tokens per micro-batch through the plain head, and ran out of its 140 GiB.)"""
    config = dataclasses.replace(engine_config(plan, plan.micro_batches[-1]), model=ModelConfig(
        override_config={"attn_implementation": attention}, use_remove_padding=True, use_fused_kernels=True))
    engine = build_fsdp_engine(path, config)
    budget = plan.step_token_budget
    module = engine.module
    # as the one-GPU worker does: share the module, or generate from a copy in the rollout dtype (bf16)
    copy_dtype = compute_rollout_copy_dtype("auto", device, next(module.parameters()).dtype)
    generator = module if copy_dtype is None else copy.deepcopy(module).to(copy_dtype)
    rollout = ROLLOUTS.get("native")(generator, tokenizer, SamplingParams(
        temperature=1.0, max_new_tokens=plan.response_len, n=plan.step_n), max_num_seqs=plan.step_prompts * plan.step_n)
    rollout.shares_training_weights = copy_dtype is None

    def generate():
        # As the worker does (rollout.free_cache_engine=True): the KV cache exists only while generating. The
        # 2026-11-28 H200 row kept it (256 slots x 768 positions, 16 GB in bf16 for the 1.46B llama) through the
        # log-prob and update passes, and ran out of memory.
        rollout.wake_up()
        if copy_dtype is not None:
            rollout.update_weights(engine.named_full_params())
        output = rollout.generate_sequences(prompts)
        rollout.sleep()
        return output

    prompts = random_batch(module.config.vocab_size, plan.step_prompts, plan.prompt_len, 0)
    prompts = DataProto.from_dict(tensors={k: prompts.batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    params = sum(p.numel() for p in module.parameters())
    peak_gib = {}  # per stage: the most memory it held, so an out-of-memory row says where

    def stage(label: str, fn):
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            return timed(fn)
        except Exception as error:
            raise RuntimeError(f"{label} failed (peak GiB of the stages before: {peak_gib}): {error!r}"[:900]) from error
        finally:
            if on_cuda:
                peak_gib[label] = torch.cuda.max_memory_allocated() / 2**30

    for attempt in range(2):  # the first step warms up (graph capture, allocator); the second is reported
        batch, gen_s = stage("generate", generate)
        _, logp_s = stage("log_prob", lambda: engine.compute_log_prob(batch, max_token_len=budget))
        _, update_s = stage("update", lambda: engine.train_batch(engine.split_micro_batches(batch, None, budget)[0], nll_loss))
    tokens = int(batch.batch["attention_mask"].sum())
    row = {"model": name, "attention": attention, "params_b": params / 1e9, "rollout_dtype": str(copy_dtype or "shared"), "rows": len(batch), "tokens": tokens, "gen_s": gen_s,
           "log_prob_s": logp_s, "update_s": update_s, "step_s": gen_s + logp_s + update_s,
           "tokens_per_s": tokens / (gen_s + logp_s + update_s), **{f"peak_gib_{k}": v for k, v in peak_gib.items()}}
    if on_cuda:
        row["update_mfu_pct"] = 100 * 6 * params * tokens / update_s / peak_flops()
    del rollout, engine, module, generator
    return row


def section_steps(plan: Plan, path_of, tokenizer, device: torch.device, on_cuda: bool, rows: list[dict],
                  on_row=lambda: None) -> list[dict]:
    """Generation (native rollout on the engine's module, as one GPU shares it), log-prob and update of
    `step_prompts x step_n` rows per model, appended to `rows` (`path_of(name)`: its checkpoint; `on_row()` after
    each row)."""
    for name in plan.step_models:
        for attention in plan.step_attention:
            try:
                row = _step_row(plan, name, path_of(name), tokenizer, device, on_cuda, attention)
            except Exception as error:  # an out-of-memory shape: say so and go on to the next model
                traceback.print_exc()
                print(f"\n## step row: {name}, {attention} failed: {error!r}"[:1200])
                release_memory()
                continue
            rows.append(row)
            print_table(f"step row: {name}, {attention}", [row])
            on_row()
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models and batches (a CPU check in seconds)")
    parser.add_argument("--sections", default="engine,ab,levers,decode,steps")
    parser.add_argument("--step-models", help="comma-separated shapes for the step table (default: the plan's)")
    parser.add_argument("--step-attention", default="sdpa",
                        help="comma-separated attention kernels of the step rows (sdpa, flex_attention)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and device.index is not None:
        torch.cuda.set_device(device)
    plan = TINY_PLAN if args.tiny else GPU_PLAN
    if args.step_models:
        unknown = set(args.step_models.split(",")) - set(SHAPES) - set(TINY)
        if unknown:
            parser.error(f"--step-models: unknown {sorted(unknown)}; choose from {sorted({*SHAPES, *TINY})}")
        plan = dataclasses.replace(plan, step_models=tuple(args.step_models.split(",")))
    plan = dataclasses.replace(plan, step_attention=tuple(args.step_attention.split(",")))
    tokenizer = build_tiny_tokenizer("local" if args.tiny else "auto")  # local: 402 tokens, tiny models
    sections = args.sections.split(",")
    report = {"device": torch.cuda.get_device_name(device) if on_cuda else "cpu", "torch": torch.__version__,
              "plan": dataclasses.asdict(plan)}
    print(f"# gpu_profile on {report['device']}, torch {torch.__version__}, {'tiny' if args.tiny else 'full'} plan")
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"gpu_profile_{report['device'].replace(' ', '_')}{'_tiny' if args.tiny else ''}.json"

    def save_report() -> None:  # after every section, so a run cut by its time limit keeps what it measured
        target.write_text(json.dumps(report, indent=1, default=str))

    def attempt(section: str, fn):  # a failed section (out of memory, say) is reported and the next one runs
        try:
            return fn()
        except Exception as error:
            traceback.print_exc()
            print(f"\n## {section} failed: {error!r}"[:600])
            report[f"{section}_error"] = repr(error)[:2000]
            save_report()
            release_memory()
            return None

    with tempfile.TemporaryDirectory() as tmp:
        def path_of(name: str) -> str:  # saved when first needed: a cut run spends no time on unused checkpoints
            return save_model(name, Path(tmp), tokenizer)

        vocab = len(tokenizer)
        if "engine" in sections:
            engine = attempt("engine", lambda: section_engine(plan, path_of(plan.engine_model), vocab, on_cuda))
        if "engine" in sections and engine is not None:
            report["engine"] = engine
            print_table(f"engine passes ({plan.engine_model}, {plan.batch} x {plan.prompt_len + plan.response_len} tokens)",
                        [{"pass": p, **{k: v for k, v in engine[p].items() if not isinstance(v, (list, dict))}}
                         for p in ("update", "log_prob")])
            for p in ("update", "log_prob"):
                print_table(f"top ops: {p}", [{"op": o, "ms": ms, "calls": c} for o, ms, c in engine[p]["top_ops_ms"]])
                print_table(f"top host ops: {p}", [{"op": o, "host_ms": ms, "calls": c}
                                                   for o, ms, c in engine[p]["top_host_ops_ms"]])
                print(f"memcpy kinds ({p}): {engine[p]['memcpy_kinds']}")
            print(f"\n## sync debug (one update): {engine['sync_debug']}")
            save_report()
        if "ab" in sections:
            report["ab"] = attempt("ab", lambda: section_ab(plan, path_of(plan.engine_model), vocab)) or {}
            print_table("A/B: update seconds", [{"variant": k, "update_s": v} for k, v in report["ab"].items()])
            save_report()
        if "levers" in sections:
            report["levers"] = attempt("levers", lambda: section_levers(
                plan, path_of(plan.engine_model), vocab, on_cuda)) or []
            print_table(f"levers: update and log-prob per precision path and AdamW kernel ({plan.engine_model})",
                        report["levers"])
            save_report()
        if "decode" in sections:
            report["decode_ops"] = {}
            report["decode"] = attempt("decode", lambda: section_decode(plan, path_of(plan.engine_model), tokenizer, device,
                                                                        on_cuda, report["decode_ops"])) or []
            print_table("decode step per rollout", report["decode"])
            for call, ranked in report["decode_ops"].items():  # the whole call: divide by its steps for one step
                print_table(f"top ops: {call} ({plan.decode_tokens} tokens)",
                            [{"op": o, "ms": ms, "calls": c} for o, ms, c in ranked["top_ops_ms"]])
                print_table(f"top host ops: {call}", [{"op": o, "host_ms": ms, "calls": c}
                                                      for o, ms, c in ranked["top_host_ops_ms"]])
            save_report()
        if "steps" in sections:
            report["steps"] = []
            section_steps(plan, path_of, tokenizer, device, on_cuda, report["steps"], on_row=save_report)
            print_table("step table (no Ray)", report["steps"])
            save_report()
    print(f"\nwrote {target}")


if __name__ == "__main__":
    main()
