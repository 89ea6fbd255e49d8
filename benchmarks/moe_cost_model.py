"""A cost model of one MoE training step under expert parallelism (EP) x FSDP2, as the training engine builds it
(`engines/training/expert_parallel.py`): time, all-to-all volume and memory per GPU.

The layout: `world` ranks all take different data. FSDP2 shards the dense part (attention, dense layers, shared
experts, routers, embeddings) over all of them. Each rank of an `ep` group holds E / ep whole experts, and the
experts are sharded again by FSDP2 over `efsdp = world / ep` ranks. Every term is a small pure function; the
collectives' ring costs and the GPU constants come from `step_cost_model.py`:

- compute: 2 FLOPs per *active* matmul parameter per token (the router's top-k experts, the shared ones, the
  attention and the dense layers) plus attention's quadratic term and the head at the response positions; a
  training micro-batch is 3 passes (4 with activation checkpointing); `imbalance` (the slowest rank's routed tokens
  over the mean, logged as `actor/moe/tokens_per_expert_max_over_mean`) stretches the routed experts' share;
- all-to-all: per MoE layer and micro-batch, one dispatch and one combine of (tokens x top_k x hidden) per rank in
  every forward pass (the recompute included) and both again in the backward;
- FSDP: the dense part gathered over all ranks, each rank's experts over efsdp (none when ep = world), before
  forward and again before backward, and their gradients reduce-scattered, in every micro-batch;
- memory: 16 bytes per parameter of sharded state over all ranks (EP x efsdp covers them too), the bf16 reference
  sharded alike, two gathered layers (their experts: E / ep), one layer's gradient, the activations of one
  micro-batch (with the routed copies: top_k rows per token) and the chunked vocabulary head.

    python benchmarks/moe_cost_model.py                   # Qwen3-30B-A3B and a DeepSeek-V3-sized model, 8-256 GPUs
    python benchmarks/moe_cost_model.py --measured benchmarks/results/moe_ep_layouts_<UTC>.json   # check on this CPU

`--measured` takes what `benchmarks/moe_ep_layouts.py` wrote (1 worker, 2 workers FSDP, 2 workers EP=2 on
a small MoE) and prints the model's prediction for each.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the sibling cost model

from benchmarks.step_cost_model import H100, USABLE_MEMORY, Hardware, RLStep, compute_collective_seconds  # noqa: E402


@dataclass(frozen=True)
class MoeShape:
    """An MoE decoder's sizes. `attention_params` per layer is given whole (MLA's low-rank projections included);
    the first `dense_layers` layers have a dense MLP of `dense_intermediate`."""

    hidden: int
    layers: int
    dense_layers: int
    attention_params: int
    heads: int
    qk_head_dim: int
    v_head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int  # 0: no shared expert
    dense_intermediate: int
    vocab: int
    tied: bool = False

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


QWEN3_30B_A3B = MoeShape(hidden=2048, layers=48, dense_layers=0, attention_params=2 * 2048 * 4096 + 2 * 2048 * 512,
                         heads=32, qk_head_dim=128, v_head_dim=128, experts=128, top_k=8, moe_intermediate=768,
                         shared_intermediate=0, dense_intermediate=0, vocab=151936)
"""Qwen3-30B-A3B: 32 query heads of 128 (q: 2048 -> 4096), 4 key/value heads, 128 experts, 8 active."""

DEEPSEEK_V3 = MoeShape(hidden=7168, layers=61, dense_layers=3,
                       attention_params=7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168,
                       heads=128, qk_head_dim=192, v_head_dim=128, experts=256, top_k=8, moe_intermediate=2048,
                       shared_intermediate=2048, dense_intermediate=18432, vocab=129280)
"""DeepSeek-V3: MLA (q rank 1536, kv rank 512, 128 heads of 128 + 64 rope), 3 dense layers, 256 routed experts
(8 active) and 1 shared expert of 2048; multi-token prediction left out."""

MOE_MODELS = {"Qwen3-30B-A3B": QWEN3_30B_A3B, "DeepSeek-V3": DEEPSEEK_V3}


@dataclass(frozen=True)
class EpLayout:
    """`world` ranks of different data; experts split over `ep` of them and sharded over the other world / ep."""

    world: int
    ep: int = 1

    @property
    def efsdp(self) -> int:
        return self.world // self.ep


# ----------------------------------------------------------------------------------------------- sizes and FLOPs
def compute_expert_layer_params(shape: MoeShape) -> int:
    """Routed expert weights of one MoE layer: E x 3 x hidden x moe_intermediate (gate, up, down)."""
    return shape.experts * 3 * shape.hidden * shape.moe_intermediate


def compute_dense_layer_params(shape: MoeShape, moe: bool) -> int:
    """The rest of one layer: attention, two norms and, for an MoE layer, the router and the shared expert, for a
    dense layer its MLP."""
    mlp = (shape.experts * shape.hidden + 3 * shape.hidden * shape.shared_intermediate) if moe else (
        3 * shape.hidden * shape.dense_intermediate)
    return shape.attention_params + 2 * shape.hidden + mlp


def compute_root_params(shape: MoeShape) -> int:
    """Embedding, head (unless tied) and final norm."""
    return shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden


def compute_moe_params(shape: MoeShape) -> dict[str, int]:
    """`total`, `active` (per token: top_k of the routed experts) and `experts` (all routed expert weights)."""
    experts = shape.moe_layers * compute_expert_layer_params(shape)
    dense = (shape.moe_layers * compute_dense_layer_params(shape, True)
             + shape.dense_layers * compute_dense_layer_params(shape, False) + compute_root_params(shape))
    active_experts = experts * shape.top_k // shape.experts
    return {"total": dense + experts, "active": dense + active_experts, "experts": experts}


def compute_moe_flops(shape: MoeShape, tokens: float, seq_len: int, response_tokens: float, *, passes: float,
                      causal_fraction: float, imbalance: float = 1.0) -> float:
    """FLOPs of `passes` passes over `tokens` tokens on the slowest rank's share of routed work: 2 per active
    matmul parameter per token (routed experts x `imbalance`), attention's 2 x seq_len x heads x (qk + v head dims)
    x `causal_fraction` per token and layer, and the head at `response_tokens` positions."""
    params = compute_moe_params(shape)
    root = compute_root_params(shape)
    routed = params["experts"] * shape.top_k / shape.experts
    other = params["active"] - routed - root - shape.layers * 2 * shape.hidden  # norms are not matmuls
    attention = 2 * seq_len * shape.heads * (shape.qk_head_dim + shape.v_head_dim) * causal_fraction * shape.layers
    head = 2 * shape.hidden * shape.vocab * response_tokens
    return passes * ((2 * (other + imbalance * routed) + attention) * tokens + head)


# ----------------------------------------------------------------------------------------------- communication
def compute_all_to_all_bytes(shape: MoeShape, layout: EpLayout, micro_tokens: int, micro_batches: int, *,
                             forward_passes: int, backward: bool, value_bytes: int) -> float:
    """Bytes each rank sends in the EP all-to-alls of one step: per MoE layer and micro-batch, dispatch and combine
    of (tokens x top_k x hidden) in every forward pass and again in the backward; (ep - 1) / ep of it leaves."""
    if layout.ep == 1:
        return 0.0
    one = micro_tokens * shape.top_k * shape.hidden * value_bytes * (layout.ep - 1) / layout.ep
    calls = 2 * (forward_passes + (1 if backward else 0))
    return micro_batches * shape.moe_layers * calls * one


def compute_all_to_all_seconds(shape: MoeShape, layout: EpLayout, micro_tokens: int, micro_batches: int, *,
                               forward_passes: int, backward: bool, value_bytes: int, bandwidth: float,
                               latency: float) -> float:
    """The EP all-to-alls of one step at the ring model's cost (not overlapped with compute: the experts wait for
    their tokens)."""
    if layout.ep == 1:
        return 0.0
    one = compute_collective_seconds("all_to_all", micro_tokens * shape.top_k * shape.hidden * value_bytes,
                                     layout.ep, bandwidth, latency)
    calls = 2 * (forward_passes + (1 if backward else 0))
    return micro_batches * shape.moe_layers * calls * one


def compute_moe_fsdp_seconds(shape: MoeShape, layout: EpLayout, micro_batches: int, *, backward: bool,
                             value_bytes: int, grad_bytes: int, bandwidth: float, latency: float,
                             expert_bandwidth: float, expert_latency: float) -> float:
    """FSDP2 per step: every layer's dense part over all ranks and its experts (E / ep of them) over efsdp, gathered
    before forward and again before backward, gradients reduce-scattered; the root once per micro-batch."""
    def seconds(params: float, ranks: int, bw: float, lat: float) -> float:
        gather = compute_collective_seconds("all_gather", params * value_bytes, ranks, bw, lat)
        if not backward:
            return gather
        return 2 * gather + compute_collective_seconds("reduce_scatter", params * grad_bytes, ranks, bw, lat)

    dense = (shape.moe_layers * seconds(compute_dense_layer_params(shape, True), layout.world, bandwidth, latency)
             + shape.dense_layers * seconds(compute_dense_layer_params(shape, False), layout.world, bandwidth, latency))
    experts = shape.moe_layers * seconds(compute_expert_layer_params(shape) / layout.ep, layout.efsdp,
                                         expert_bandwidth, expert_latency)
    root = compute_collective_seconds("all_gather", compute_root_params(shape) * value_bytes, layout.world,
                                      bandwidth, latency)
    if backward:
        root += compute_collective_seconds("reduce_scatter", compute_root_params(shape) * grad_bytes, layout.world,
                                           bandwidth, latency)
    return micro_batches * (dense + experts + root)


# ----------------------------------------------------------------------------------------------- memory
def compute_moe_activation_values(shape: MoeShape) -> float:
    """Values one MoE layer keeps for backward per token: the norms' inputs and outputs (4 x hidden), q, k, v and
    the attention output (heads x (2 qk + 2 v) head dims), the router logits (E), and per routed copy (top_k of
    them) the dispatched input and output (2 x hidden) and the expert's gate, up, activation and product
    (4 x moe_intermediate); the shared expert's 4 x its width."""
    attention = shape.heads * (2 * shape.qk_head_dim + 2 * shape.v_head_dim)
    routed = shape.top_k * (2 * shape.hidden + 4 * shape.moe_intermediate)
    return 4 * shape.hidden + attention + shape.experts + routed + 4 * shape.shared_intermediate


def compute_moe_memory(shape: MoeShape, layout: EpLayout, micro_tokens: int, *, value_bytes: int = 2,
                       grad_bytes: int = 4, checkpointing: bool = True, activation_factor: float = 1.16,
                       head_chunk: int = 1024, reference: bool = True) -> dict[str, float]:
    """Peak bytes per GPU of a training step, by part, and their `total`."""
    params = compute_moe_params(shape)
    layer = compute_dense_layer_params(shape, True) + compute_expert_layer_params(shape) / layout.ep
    per_layer = activation_factor * compute_moe_activation_values(shape) * micro_tokens * value_bytes
    activations = (shape.layers * shape.hidden * micro_tokens * value_bytes + per_layer) if checkpointing else (
        shape.layers * per_layer)
    parts = {
        "state": 16.0 * params["total"] / layout.world,
        "reference": (2.0 * params["total"] / layout.world) if reference else 0.0,
        "gathered": (2 * layer + compute_root_params(shape)) * value_bytes + layer * grad_bytes,
        "activations": activations,
        "head": 3 * head_chunk * shape.vocab * 4.0 + shape.vocab * shape.hidden * 4.0,  # chunk logits, weight grad
    }
    parts["total"] = sum(parts.values())
    return parts


# ----------------------------------------------------------------------------------------------- one step
def estimate_moe_update(shape: MoeShape, layout: EpLayout, step: RLStep, hardware: Hardware, *, micro_rows: int,
                        imbalance: float = 1.0) -> dict[str, float]:
    """Seconds and bytes of one update epoch of `step` (every rank takes sequences / world rows): compute, the
    all-to-alls, FSDP (hidden behind compute when `hardware.overlap_fsdp`), the total and the all-to-all bytes."""
    seq_len = step.prompt_len + step.response_len
    rows = step.prompts * step.samples
    rows_per_rank = math.ceil(rows / layout.world)
    micro_batches = math.ceil(rows_per_rank / micro_rows)
    micro_tokens = micro_rows * seq_len
    forward_passes = 2 if step.checkpointing else 1
    compute = compute_moe_flops(shape, rows_per_rank * seq_len, seq_len, rows_per_rank * step.response_len,
                                passes=forward_passes + 2, causal_fraction=hardware.causal_fraction,
                                imbalance=imbalance) / hardware.flops
    inside = layout.ep <= hardware.devices_per_node
    ep_link = (hardware.bandwidth, hardware.latency) if inside else (hardware.inter_bandwidth, hardware.inter_latency)
    world_link = (hardware.bandwidth, hardware.latency) if layout.world <= hardware.devices_per_node else (
        hardware.inter_bandwidth, hardware.inter_latency)
    # the efsdp peers of a rank are ep ranks apart: inside one node only when the whole world is
    a2a = dict(forward_passes=forward_passes, backward=True, value_bytes=hardware.value_bytes)
    all_to_all = compute_all_to_all_seconds(shape, layout, micro_tokens, micro_batches, **a2a,
                                            bandwidth=ep_link[0], latency=ep_link[1])
    fsdp = compute_moe_fsdp_seconds(shape, layout, micro_batches, backward=True, value_bytes=hardware.value_bytes,
                                    grad_bytes=4, bandwidth=world_link[0], latency=world_link[1],
                                    expert_bandwidth=world_link[0], expert_latency=world_link[1])
    exposed = max(0.0, fsdp - compute) if hardware.overlap_fsdp else fsdp
    return {"compute_s": compute, "all_to_all_s": all_to_all, "fsdp_s": fsdp,
            "total_s": compute + all_to_all + exposed,
            "all_to_all_bytes": compute_all_to_all_bytes(shape, layout, micro_tokens, micro_batches, **a2a),
            "micro_batches": micro_batches}


def ep_sizes(shape: MoeShape, world: int) -> list[int]:
    """The expert-parallel sizes the engine takes on `world` ranks: divisors of both the experts and the world."""
    return [ep for ep in range(1, world + 1) if world % ep == 0 and shape.experts % ep == 0]


def rank_moe_layouts(shape: MoeShape, world: int, step: RLStep, hardware: Hardware, *,
                     imbalance: float = 1.0) -> list[dict]:
    """Every EP size on `world` GPUs with the largest micro-batch (1-16 sequences) that fits, fastest first;
    layouts where not even one sequence fits come last with their memory at one sequence."""
    rows = []
    seq_len = step.prompt_len + step.response_len
    for ep in ep_sizes(shape, world):
        layout = EpLayout(world, ep)
        best = None
        for micro_rows in (16, 8, 4, 2, 1):
            memory = compute_moe_memory(shape, layout, micro_rows * seq_len, checkpointing=step.checkpointing)
            if memory["total"] <= USABLE_MEMORY * hardware.memory:
                best = (micro_rows, memory)
                break
        if best is None:
            memory = compute_moe_memory(shape, layout, seq_len, checkpointing=step.checkpointing)
            rows.append({"layout": layout, "fits": False, "memory": memory})
            continue
        micro_rows, memory = best
        update = estimate_moe_update(shape, layout, step, hardware, micro_rows=micro_rows, imbalance=imbalance)
        rows.append({"layout": layout, "fits": True, "memory": memory, "micro_rows": micro_rows, "update": update})
    return sorted(rows, key=lambda row: (not row["fits"], row["update"]["total_s"] if row["fits"] else 0.0))


def print_moe_table(step: RLStep, hardware: Hardware, imbalance: float) -> None:
    print(f"RL step: {step.prompts} prompts x {step.samples} samples x ({step.prompt_len} + {step.response_len}) "
          f"tokens, one update epoch, activation checkpointing, routed-load imbalance {imbalance:.2f}\n")
    print("| model | GPUs | pick | sequences per micro-batch | GB per GPU (state, reference, gathered, activations) | "
          "update s (compute, all-to-all, FSDP) | all-to-all GB sent per GPU | ep=1 (FSDP only) | runner-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape in MOE_MODELS.items():
        for world in (8, 16, 32, 64, 128, 256):
            ranked = rank_moe_layouts(shape, world, step, hardware, imbalance=imbalance)
            plain = next(row for row in ranked if row["layout"].ep == 1)
            plain_text = (f"{plain['update']['total_s']:.0f} s" if plain["fits"]
                          else f"does not fit ({plain['memory']['total'] / 1e9:.0f} GB)")
            best = ranked[0]
            if not best["fits"]:
                print(f"| {name} | {world} | none fits | | {best['memory']['total'] / 1e9:.0f} at 1 sequence | | | "
                      f"{plain_text} | |")
                continue
            m, u = best["memory"], best["update"]
            runner = next((row for row in ranked[1:] if row["fits"]), None)
            runner_text = (f"ep={runner['layout'].ep}: {runner['update']['total_s'] / u['total_s']:.2f}x"
                           if runner else "")
            print(f"| {name} | {world} | ep={best['layout'].ep}, efsdp={best['layout'].efsdp} | {best['micro_rows']} | "
                  f"{m['total'] / 1e9:.0f} ({m['state'] / 1e9:.0f}, {m['reference'] / 1e9:.0f}, "
                  f"{m['gathered'] / 1e9:.1f}, {m['activations'] / 1e9:.0f}) | {u['total_s']:.0f} "
                  f"({u['compute_s']:.0f}, {u['all_to_all_s']:.0f}, {u['fsdp_s']:.0f}) | "
                  f"{u['all_to_all_bytes'] / 1e9:.0f} | {plain_text} | {runner_text} |")


# ----------------------------------------------------------------------------------------------- CPU check
def cpu_shape(model: dict) -> MoeShape:
    """The benchmark's small Qwen3-MoE (benchmarks/moe_ep_layouts.py writes its config)."""
    head_dim = model["head_dim"]
    attention = 2 * model["hidden"] * model["heads"] * head_dim + 2 * model["hidden"] * model["kv_heads"] * head_dim
    return MoeShape(hidden=model["hidden"], layers=model["layers"], dense_layers=0, attention_params=attention,
                    heads=model["heads"], qk_head_dim=head_dim, v_head_dim=head_dim, experts=model["experts"],
                    top_k=model["top_k"], moe_intermediate=model["moe_intermediate"], shared_intermediate=0,
                    dense_intermediate=0, vocab=model["vocab"], tied=True)


def print_cpu_check(results: dict) -> None:
    """Predicted against measured for the 2-worker runs, with the compute rate fitted to the 1-worker run and the
    gloo link and FSDP2 bandwidth of docs/parallelism.md's fit."""
    shape = cpu_shape(results["config"]["model"])
    runs = {run["name"]: run for run in results["rows"]}
    single = runs["1 worker"]
    tokens, seq_len = single["tokens"], single["seq_len"]
    flops = compute_moe_flops(shape, tokens, seq_len, single["response_tokens"], passes=3, causal_fraction=1.0)
    rate = flops / single["step_s"]  # the 2 cores' achieved rate on this model (fitted)
    host = results["host"]
    print(f"fitted: {rate / 1e9:.1f} GFLOP/s on the 1-worker step ({single['step_s']:.2f} s, host {host['cpu_model']}, "
          f"{host['cpu_count']} cores, load before {(results['load_before'] or ['not recorded'])[0]})")
    print("| run | step s measured | predicted (compute + all-to-all + FSDP) | measured / predicted | "
          "forward all-to-alls: calls, MB sent measured | MB predicted (balanced routing) |")
    print("|---|---|---|---|---|---|")
    for name, run in runs.items():
        if name == "1 worker":
            continue
        layout = EpLayout(2, run["ep"])
        per_rank_tokens = run["tokens"] / 2
        compute = compute_moe_flops(shape, per_rank_tokens, seq_len, run["response_tokens"] / 2, passes=3,
                                    causal_fraction=1.0) / (rate / 2)  # 1 core per worker
        a2a = compute_all_to_all_seconds(shape, layout, run["micro_tokens"], run["micro_batches"], forward_passes=1,
                                         backward=True, value_bytes=4, bandwidth=0.78e9, latency=190e-6)
        fsdp = compute_moe_fsdp_seconds(shape, layout, run["micro_batches"], backward=True, value_bytes=4,
                                        grad_bytes=4, bandwidth=0.87e9, latency=190e-6, expert_bandwidth=0.87e9,
                                        expert_latency=190e-6)
        predicted = compute + a2a + fsdp
        bytes_predicted = compute_all_to_all_bytes(shape, layout, run["micro_tokens"], run["micro_batches"],
                                                   forward_passes=1, backward=False, value_bytes=4)
        print(f"| {name} | {run['step_s']:.2f} | {predicted:.2f} ({compute:.2f} + {a2a:.2f} + {fsdp:.2f}) | "
              f"{run['step_s'] / predicted:.2f} | {run.get('all_to_all_calls', 0)}, "
              f"{run.get('all_to_all_bytes', 0) / 1e6:.2f} | {bytes_predicted / 1e6:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", help="JSON written by benchmarks/moe_ep_layouts.py: check the model")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="slowest rank's routed tokens over the mean (actor/moe/tokens_per_expert_max_over_mean)")
    parser.add_argument("--prompts", type=int, default=RLStep.prompts)
    parser.add_argument("--response-len", type=int, default=RLStep.response_len)
    args = parser.parse_args()
    if args.measured:
        print_cpu_check(json.loads(Path(args.measured).read_text()))
        print()
    print_moe_table(RLStep(prompts=args.prompts, response_len=args.response_len), H100, args.imbalance)


if __name__ == "__main__":
    main()
