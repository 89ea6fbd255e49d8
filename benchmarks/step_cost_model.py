"""A cost model of one training step (time and memory per device) for hybridflow's parallel layouts.

Layouts are dp x tp x sp over `world = dp * tp * sp` devices, as the training engine builds them: FSDP2 shards
over the `world / tp` ranks that are not tensor-parallel peers (with Ulysses, sequence-parallel peers are FSDP
ranks too), DTensor tensor parallelism splits each layer over `tp` ranks, Ulysses splits each packed row over
`sp` ranks. Every term is a small pure function below:

- compute: 2 x (matmul parameters) FLOPs per token per pass (6 x parameters x tokens for a training step), plus
  the head's 2 x hidden x vocab per response token, plus attention's 4 x seq_len x hidden per token (QK^T and AV;
  x 0.5 when the kernel skips the masked half); a training micro-batch is 3 passes (4 with activation
  checkpointing), a log-prob pass 1; divided among the devices at an achieved FLOP rate;
- FSDP: per micro-batch and layer, an all-gather of the layer's parameters before forward and again before
  backward (`reshard_after_forward=True`) and a reduce-scatter of its gradients (the engine syncs gradients in
  every micro-batch's backward);
- tensor parallel: per micro-batch and layer, 2 all-reduces of (tokens x hidden) in forward (after o_proj and
  down_proj) and 2 in backward (the inputs' gradients of q/k/v and gate/up);
- Ulysses: per micro-batch and layer, 4 all-to-alls in forward (q, k, v in, attention output back) of
  (tokens / sp x width) per rank, and 4 in backward;
- a collective over p ranks costs `steps x latency + bytes sent per rank / bandwidth` (ring algorithms);
- memory: sharded state (parameters, gradients, AdamW moments: 16 bytes per parameter with fp32 master weights),
  the gathered layers and the root module in flight, one micro-batch's activations (split by tp for the split
  tensors, by sp for all), the fp32 logits of the response positions (split by tp and sp), and for rollouts the
  KV cache.

    python benchmarks/step_cost_model.py --measured benchmarks/results/parallel_layouts_2026-11-25.json
    python benchmarks/step_cost_model.py        # layouts for 7B/32B/70B on 8-64 H100s (assumed constants)
    python benchmarks/step_cost_model.py --prompts 64 --response-len 31744 --detail 32B:16   # long responses

`--measured` takes what `benchmarks/parallel_layouts.py --out` wrote and fits, from its fastest calls: the 2 cores'
achieved FLOP rate and a per-micro-batch overhead (1-worker steps), the gloo link's latency and bandwidth (timed
collectives), FSDP2's effective bandwidth (the dp=2 step with the fewest micro-batches) and the activation factor
(1-worker saved activations); then it prints predicted against measured for every layout. The GPU tables use
stated constants (assumptions, not measurements) and print the layout to pick for each model and cluster size.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False


@dataclass(frozen=True)
class Layout:
    """dp x tp x sp devices; tp and sp are not combined by the engine (see docs/parallelism.md)."""

    dp: int
    tp: int = 1
    sp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.sp

    @property
    def fsdp(self) -> int:
        """Ranks FSDP2 shards over: every rank that is not a tensor-parallel peer."""
        return self.dp * self.sp


@dataclass(frozen=True)
class Workload:
    """One step's data: `sequences` rows of `seq_len` tokens (the last `response_len` are the response), cut into
    micro-batches of `micro_batch_tokens` tokens per data-parallel group."""

    sequences: int
    seq_len: int
    response_len: int
    micro_batch_tokens: int


@dataclass(frozen=True)
class Hardware:
    """Rates of one device and its links; GPU values are assumptions, CPU values are fitted here."""

    flops: float  # achieved FLOP/s per device
    bandwidth: float  # bytes/s per rank within a node
    latency: float  # seconds per ring step within a node
    memory: float  # bytes per device
    value_bytes: int  # bytes per activation / gathered parameter value (2: bf16, 4: fp32)
    causal_fraction: float  # share of the S x S attention scores computed (0.5: causal kernels skip the rest)
    overlap_fsdp: bool  # FSDP's prefetched all-gathers and reduce-scatters hide behind compute
    devices_per_node: int = 1 << 30
    inter_bandwidth: float = 0.0  # bytes/s per rank across nodes
    inter_latency: float = 0.0
    micro_batch_overhead: float = 0.0  # seconds per micro-batch and pass besides the FLOPs (Python, glue ops)
    fsdp_bandwidth: float = 0.0  # bytes/s FSDP2 achieves with its copies in and out of the buffers; 0: the link's


# ----------------------------------------------------------------------------------------------- sizes and FLOPs
def compute_layer_params(shape: ModelShape) -> int:
    """Parameters of one decoder layer: q/o (hidden^2 each), k/v (hidden x kv width each), the gated MLP
    (3 x hidden x intermediate) and two RMSNorm weights."""
    kv_width = shape.kv_heads * (shape.hidden // shape.heads)
    return 2 * shape.hidden**2 + 2 * shape.hidden * kv_width + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden


def compute_params(shape: ModelShape) -> int:
    """All parameters: the layers, the embedding, the head (unless tied) and the final norm."""
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    return shape.layers * compute_layer_params(shape) + embeddings + shape.hidden


def compute_flops(shape: ModelShape, workload: Workload, *, passes: float, causal_fraction: float) -> float:
    """FLOPs of `passes` passes (1: forward; 3: forward + backward; 4: with recomputation) over one step's tokens.

    Matmuls: 2 FLOPs per parameter per token; the head only at the response positions (the engine projects only
    the positions that predict response tokens); attention 4 x seq_len x hidden per token x `causal_fraction`."""
    tokens = workload.sequences * workload.seq_len
    matmul_params = shape.layers * (compute_layer_params(shape) - 2 * shape.hidden)
    attention = 4 * workload.seq_len * shape.hidden * causal_fraction * shape.layers
    head = 2 * shape.hidden * shape.vocab * workload.sequences * workload.response_len
    return passes * ((2 * matmul_params + attention) * tokens + head)


def compute_bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline-parallel pass (not implemented in hybridflow; docs/parallelism.md): GPipe and
    1F1B fill and drain `stages - 1` micro-batch slots around `micro_batches`; an interleaved schedule with
    `virtual_stages` chunks per rank shrinks the fill and drain by that factor: (p - 1) / (v m + p - 1)."""
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def compute_micro_batches(layout: Layout, workload: Workload) -> int:
    """Micro-batches each data-parallel group runs per step (whole sequences per micro-batch)."""
    rows_per_micro = max(1, workload.micro_batch_tokens // workload.seq_len)
    return math.ceil(workload.sequences / layout.dp / rows_per_micro)


# ----------------------------------------------------------------------------------------------- communication
def compute_collective_seconds(kind: str, num_bytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One ring collective over `ranks` ranks. `num_bytes`: the whole tensor for all-reduce, the output of an
    all-gather, the input of a reduce-scatter, each rank's input of an all-to-all. 0 for one rank."""
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks
    factor = {"all_reduce": 2 * share, "all_gather": share, "reduce_scatter": share, "all_to_all": share}[kind]
    sent = factor * num_bytes
    steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
    return steps * latency + sent / bandwidth


def compute_fsdp_seconds(shape: ModelShape, layout: Layout, micro_batches: int, *, backward: bool, value_bytes: int,
                         grad_bytes: int, bandwidth: float, latency: float) -> float:
    """FSDP2 per step: each micro-batch gathers every layer before forward (and again before backward) and
    reduce-scatters its gradients; the root (embedding, head, final norm) is gathered once per micro-batch."""
    layer = compute_layer_params(shape) / layout.tp
    root = (compute_params(shape) - shape.layers * compute_layer_params(shape)) / layout.tp

    def seconds(kind: str, params: float, dtype_bytes: int) -> float:
        return compute_collective_seconds(kind, params * dtype_bytes, layout.fsdp, bandwidth, latency)

    per_layer = seconds("all_gather", layer, value_bytes) * (2 if backward else 1)
    per_root = seconds("all_gather", root, value_bytes)
    if backward:
        per_layer += seconds("reduce_scatter", layer, grad_bytes)
        per_root += seconds("reduce_scatter", root, grad_bytes)
    return micro_batches * (shape.layers * per_layer + per_root)


def compute_tp_seconds(shape: ModelShape, layout: Layout, micro_tokens: int, micro_batches: int, *,
                       forward_passes: int, backward: bool, value_bytes: int, bandwidth: float,
                       latency: float) -> float:
    """Tensor-parallel all-reduces of (tokens x hidden): 2 per layer per forward pass, 2 per layer in backward,
    and the vocabulary-split embedding's sum once per forward."""
    calls = shape.layers * (2 * forward_passes + (2 if backward else 0)) + forward_passes
    tensor_bytes = micro_tokens * shape.hidden * value_bytes
    one = compute_collective_seconds("all_reduce", tensor_bytes, layout.tp, bandwidth, latency)
    return micro_batches * calls * one


def compute_ulysses_seconds(shape: ModelShape, layout: Layout, micro_tokens: int, micro_batches: int, *,
                            forward_passes: int, backward: bool, value_bytes: int, bandwidth: float,
                            latency: float) -> float:
    """Ulysses all-to-alls per layer and pass: q and the attention output (tokens / sp x hidden per rank), k and v
    (tokens / sp x kv width); the backward repeats the four."""
    kv_width = shape.kv_heads * (shape.hidden // shape.heads)
    local = micro_tokens / layout.sp * value_bytes
    one_pass = sum(compute_collective_seconds("all_to_all", local * width, layout.sp, bandwidth, latency)
                   for width in (shape.hidden, kv_width, kv_width, shape.hidden))
    return micro_batches * shape.layers * one_pass * (forward_passes + (1 if backward else 0))


# ----------------------------------------------------------------------------------------------- memory
def compute_state_bytes(params: float, layout: Layout, bytes_per_param: float) -> float:
    """Sharded training state per device: FSDP shards over `layout.fsdp` ranks, tensor parallelism splits by tp
    (16 bytes per parameter: fp32 master weights, fp32 gradients, two fp32 AdamW moments; 8 for bf16 throughout)."""
    return params * bytes_per_param / (layout.fsdp * layout.tp)


def compute_activation_values(shape: ModelShape, tp: int) -> float:
    """Values one decoder layer keeps for backward per token (per device), counting the tensors a Llama layer
    saves: the two norms' inputs and outputs (4 x hidden, replicated across tensor-parallel ranks), q and the
    attention output (2 x hidden), k and v (2 x kv width) and the MLP's gate, up, activation and product
    (4 x intermediate), split by tp."""
    kv_width = shape.kv_heads * (shape.hidden // shape.heads)
    return 4 * shape.hidden + (2 * shape.hidden + 2 * kv_width + 4 * shape.intermediate) / tp


def compute_activation_bytes(shape: ModelShape, layout: Layout, micro_tokens: int, *, value_bytes: int,
                             factor: float, checkpointing: bool) -> float:
    """One micro-batch's saved activations per device (Ulysses: each rank holds tokens / sp of every tensor).
    With activation checkpointing, each layer keeps its input and one layer at a time holds the rest.
    `factor` scales the counted tensors to what an implementation really keeps (fitted on this CPU)."""
    tokens = micro_tokens / layout.sp
    per_layer = factor * compute_activation_values(shape, layout.tp) * tokens * value_bytes
    if checkpointing:
        return shape.layers * shape.hidden * tokens * value_bytes + per_layer
    return shape.layers * per_layer


def compute_logits_bytes(shape: ModelShape, layout: Layout, logit_tokens: int, copies: float = 3.0) -> float:
    """fp32 logits of the response positions of one micro-batch, `copies` alive at once (logits, / temperature,
    the log-softmax's exp), split over the vocabulary by tp and over positions by sp."""
    return copies * 4 * logit_tokens * shape.vocab / (layout.tp * layout.sp)


def compute_gathered_bytes(shape: ModelShape, layout: Layout, value_bytes: int, grad_bytes: int) -> float:
    """FSDP2's unsharded buffers in flight: the current and the prefetched layer, one layer's full gradient before
    its reduce-scatter, and the root module (kept gathered between forward and backward)."""
    layer = compute_layer_params(shape) / layout.tp
    root = (compute_params(shape) - shape.layers * compute_layer_params(shape)) / layout.tp
    return (2 * layer + root) * value_bytes + layer * grad_bytes


def compute_kv_cache_bytes(shape: ModelShape, tokens: float, tp: int, value_bytes: int = 2) -> float:
    """Rollout KV cache per device for `tokens` cached tokens: keys and values of every layer; key/value heads
    split over tp (replicated once tp exceeds them)."""
    kv_heads = max(1, shape.kv_heads // tp)
    return 2 * shape.layers * kv_heads * (shape.hidden // shape.heads) * value_bytes * tokens


# ----------------------------------------------------------------------------------------------- one pass
def estimate_pass(shape: ModelShape, layout: Layout, workload: Workload, hardware: Hardware, *, train: bool,
                  checkpointing: bool = False, grad_bytes: int = 4) -> dict[str, float]:
    """Seconds of one training step (`train`) or one log-prob pass over `workload`: compute, per-micro-batch
    overhead, FSDP, tp, sp and the total (FSDP hidden behind compute when `hardware.overlap_fsdp`)."""
    forward_passes = 1 + (1 if train and checkpointing else 0)
    passes = forward_passes + (2 if train else 0)
    compute = compute_flops(shape, workload, passes=passes, causal_fraction=hardware.causal_fraction)
    compute_s = compute / (layout.world * hardware.flops)
    micro = compute_micro_batches(layout, workload)
    micro_tokens = min(workload.micro_batch_tokens, workload.sequences // layout.dp * workload.seq_len)
    micro_tokens = max(workload.seq_len, micro_tokens // workload.seq_len * workload.seq_len)
    inside = layout.tp * layout.sp <= hardware.devices_per_node
    across = layout.world > hardware.devices_per_node
    node_link, cluster_link = (hardware.bandwidth, hardware.latency), (hardware.inter_bandwidth, hardware.inter_latency)
    group_link = node_link if inside else cluster_link
    fsdp_link = cluster_link if across else node_link
    common = dict(value_bytes=hardware.value_bytes)
    fsdp = compute_fsdp_seconds(shape, layout, micro, backward=train, grad_bytes=grad_bytes,
                                bandwidth=hardware.fsdp_bandwidth or fsdp_link[0], latency=fsdp_link[1], **common)
    group = dict(forward_passes=forward_passes, backward=train, bandwidth=group_link[0], latency=group_link[1],
                 **common)
    tp = compute_tp_seconds(shape, layout, micro_tokens, micro, **group)
    sp = compute_ulysses_seconds(shape, layout, micro_tokens, micro, **group)
    overhead = micro * passes * hardware.micro_batch_overhead
    exposed_fsdp = max(0.0, fsdp - compute_s) if hardware.overlap_fsdp else fsdp
    return {"compute_s": compute_s, "overhead_s": overhead, "fsdp_s": fsdp, "tp_s": tp, "sp_s": sp,
            "total_s": compute_s + overhead + exposed_fsdp + tp + sp}


def estimate_memory(shape: ModelShape, layout: Layout, workload: Workload, hardware: Hardware, *,
                    state_bytes_per_param: float = 16.0, activation_factor: float = 1.0, checkpointing: bool = False,
                    grad_bytes: int = 4, extra_bytes: float = 0.0) -> dict[str, float]:
    """Peak bytes per device during a training step, by part, and their `total`."""
    per_group = workload.sequences // layout.dp * workload.seq_len
    micro_tokens = max(workload.seq_len, min(workload.micro_batch_tokens, per_group))
    rows = micro_tokens // workload.seq_len
    parts = {
        "state": compute_state_bytes(compute_params(shape), layout, state_bytes_per_param),
        "gathered": compute_gathered_bytes(shape, layout, hardware.value_bytes, grad_bytes),
        "activations": compute_activation_bytes(shape, layout, micro_tokens, value_bytes=hardware.value_bytes,
                                                factor=activation_factor, checkpointing=checkpointing),
        "logits": compute_logits_bytes(shape, layout, rows * workload.response_len),
        "other": extra_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts


def fit_least_squares(columns: list[list[float]], targets: list[float]) -> list[float]:
    """Coefficients c minimising sum_i (sum_j c_j columns[j][i] - targets[i])^2 (normal equations, no numpy)."""
    n = len(columns)
    gram = [[sum(a * b for a, b in zip(columns[i], columns[j])) for j in range(n)] for i in range(n)]
    rhs = [sum(a * t for a, t in zip(columns[i], targets)) for i in range(n)]
    for i in range(n):  # Gauss-Jordan elimination with partial pivoting
        pivot = max(range(i, n), key=lambda r: abs(gram[r][i]))
        gram[i], gram[pivot], rhs[i], rhs[pivot] = gram[pivot], gram[i], rhs[pivot], rhs[i]
        for r in range(n):
            if r != i:
                ratio = gram[r][i] / gram[i][i]
                gram[r] = [a - ratio * b for a, b in zip(gram[r], gram[i])]
                rhs[r] -= ratio * rhs[i]
    return [rhs[i] / gram[i][i] for i in range(n)]


# ------------------------------------------------------------------------------------- this CPU: fit and check
def cpu_model_shape(model: dict) -> ModelShape:
    """The benchmark's model (`parallel_layouts.py` results' `model`), tied embeddings as `build_tiny_model` makes."""
    return ModelShape(model["hidden"], model["layers"], model["heads"], model["kv_heads"], model["intermediate"],
                      model["vocab"], tied=True)


def cpu_workload(name: str) -> Workload:
    """`ROWSxSEQ` -> the benchmark's workload: the second half of each row is the response, one row per micro-batch."""
    rows, seq_len = (int(x) for x in name.split("x"))
    return Workload(sequences=rows, seq_len=seq_len, response_len=seq_len // 2, micro_batch_tokens=seq_len)


def fit_link(collectives: list[dict], ranks: int = 2, small_bytes: int = 16384) -> tuple[float, float]:
    """(latency s per ring step, bandwidth bytes/s) of timed collectives, t = steps x latency + sent / bandwidth:
    the latency from messages of at most `small_bytes`, the bandwidth from the larger ones, each size's fastest
    time (other jobs only ever slow a collective down)."""
    fastest: dict[tuple[str, int], float] = {}
    for row in collectives:
        key = (row["kind"], row["bytes"])
        fastest[key] = min(fastest.get(key, math.inf), row["seconds"])

    def steps(kind: str, num_bytes: int) -> float:
        return compute_collective_seconds(kind, num_bytes, ranks, bandwidth=math.inf, latency=1.0)

    def sent(kind: str, num_bytes: int) -> float:
        return compute_collective_seconds(kind, num_bytes, ranks, bandwidth=1.0, latency=0.0)

    inverse_bandwidth = 0.0
    for _ in range(3):  # each estimate refines the other: small messages still send bytes, large ones wait too
        latency = median([(t - sent(*key) * inverse_bandwidth) / steps(*key) for key, t in fastest.items()
                          if key[1] <= small_bytes])
        large = [(sent(*key), t - steps(*key) * latency) for key, t in fastest.items() if key[1] > small_bytes]
        inverse_bandwidth = sum(x * y for x, y in large) / sum(x * x for x, _ in large)
    return latency, 1.0 / inverse_bandwidth


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def measured_layout(result: dict) -> Layout:
    layout = result["layout"]
    return Layout(dp=layout["processes"] // (layout["tp"] * layout["sp"]), tp=layout["tp"], sp=layout["sp"])


def cpu_device(hardware: Hardware, threads: int) -> Hardware:
    """One process with `threads` of the 2 cores: that share of the fitted 2-core rates."""
    share = threads / 2
    return replace(hardware, flops=hardware.flops * share, micro_batch_overhead=hardware.micro_batch_overhead / share)


def fit_cpu(results: dict) -> dict:
    """Fit the constants to `parallel_layouts.py` results. Times are the fastest of each layout's repeats: other
    jobs share this machine's 2 cores, and the fastest call is the one they disturbed least.

    - FLOP rate and per-micro-batch overhead of the 2 cores: the 1-worker training steps (no communication), by
      least squares over the workloads (equal tokens in more or fewer micro-batches);
    - gloo latency and bandwidth: the timed collectives (`fit_link`);
    - FSDP's effective bandwidth: the dp=2 step with the fewest micro-batches, less its compute and overhead;
    - activation factor: the bytes autograd saved in a 1-worker micro-batch over `compute_activation_bytes`."""
    shape, single = cpu_model_shape(results["model"]), results["layouts"]["1 worker"]["ranks"][0]
    flops, micro, seconds, saved, counted = [], [], [], 0.0, 0.0
    for name in results["workloads"]:
        workload = cpu_workload(name)
        flops.append(compute_flops(shape, workload, passes=3, causal_fraction=1.0))
        micro.append(3 * compute_micro_batches(Layout(1), workload))
        seconds.append(min(single["workloads"][name]["train_s"]))
        saved += single["workloads"][name]["saved_activations"]
        counted += compute_activation_bytes(shape, Layout(1), workload.micro_batch_tokens, value_bytes=4, factor=1.0,
                                            checkpointing=False)
    if len(set(micro)) < 2:
        raise ValueError("fitting the FLOP rate and the per-micro-batch overhead needs workloads with different "
                         f"micro-batch counts; the results hold {results['workloads']}: run parallel_layouts.py "
                         "with its default --workloads 8x256,2x1024")
    inverse_flops, overhead = fit_least_squares([flops, micro], seconds)
    latency, bandwidth = fit_link(results["collectives"])
    hardware = Hardware(flops=1 / inverse_flops, bandwidth=bandwidth, latency=latency, memory=23 * 2**30,
                        value_bytes=4, causal_fraction=1.0, overlap_fsdp=False, micro_batch_overhead=overhead)
    dp = results["layouts"]["dp=2"]
    name = min(results["workloads"], key=lambda n: compute_micro_batches(Layout(2), cpu_workload(n)))
    workload, device = cpu_workload(name), cpu_device(hardware, dp["layout"]["threads"])
    rest = estimate_pass(shape, Layout(2), workload, replace(device, fsdp_bandwidth=math.inf), train=True)
    moved = compute_fsdp_seconds(shape, Layout(2), compute_micro_batches(Layout(2), workload), backward=True,
                                 value_bytes=4, grad_bytes=4, bandwidth=1.0, latency=0.0)
    fsdp_seconds = min(dp["ranks"][0]["workloads"][name]["train_s"]) - rest["total_s"]
    hardware = replace(hardware, fsdp_bandwidth=moved / fsdp_seconds)
    return {"hardware": hardware, "activation_factor": saved / counted, "fsdp_fit": f"dp=2 {name}"}


def check_cpu(results: dict, fitted: dict) -> list[dict]:
    """Predicted against measured for every measured layout and workload: a step's and a log-prob pass's time
    (the fastest repeat; each process runs at its share of the fitted 2-core rates), the saved activations of one
    micro-batch per rank, and the peak RSS above the process's RSS before the model (the model's parts of a step's
    peak)."""
    shape, rows = cpu_model_shape(results["model"]), []
    for name, result in results["layouts"].items():
        layout = measured_layout(result)
        hardware = cpu_device(fitted["hardware"], result["layout"]["threads"])
        for workload_name in results["workloads"]:
            workload = cpu_workload(workload_name)
            ranks = [rank["workloads"][workload_name] for rank in result["ranks"]]
            memory = estimate_memory(shape, layout, workload, hardware, activation_factor=fitted["activation_factor"])
            rows.append({
                "layout": name, "workload": workload_name, "memory": memory,
                "train": estimate_pass(shape, layout, workload, hardware, train=True),
                "log_prob": estimate_pass(shape, layout, workload, hardware, train=False),
                "train_s": min(ranks[0]["train_s"]), "log_prob_s": min(ranks[0]["log_prob_s"]),
                "saved": max(r["saved_activations"] for r in ranks),
                "peak": max(r["train_peak_rss"] - rank["base_rss"] for r, rank in zip(ranks, result["ranks"])),
                "load": max(result["loads"] + [r["load"] for r in ranks]),
            })
    return rows


def print_cpu_check(results: dict, fitted: dict) -> None:
    hardware = fitted["hardware"]
    print(f"fitted on this CPU (run started {results['started']}; fastest repeats): 2 cores achieve "
          f"{hardware.flops / 1e9:.0f} GFLOP/s plus {hardware.micro_batch_overhead * 1e3:.0f} ms per micro-batch and "
          f"pass (1-worker steps); gloo {hardware.latency * 1e6:.0f} us per ring step, {hardware.bandwidth / 1e9:.2f} "
          f"GB/s (timed collectives); FSDP2 with its copies {hardware.fsdp_bandwidth / 1e9:.2f} GB/s "
          f"({fitted['fsdp_fit']}); activation factor {fitted['activation_factor']:.2f} (1-worker saved activations)")
    print("| layout | workload | step s measured (fastest) | predicted (compute + overhead + fsdp + tp + sp) | ratio | "
          "log-prob s measured | predicted | ratio | saved activations MiB measured / predicted | peak RSS above base "
          "MiB measured / predicted | max load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in check_cpu(results, fitted):
        t, lp, m = row["train"], row["log_prob"], row["memory"]
        parts = " + ".join(f"{t[key]:.2f}" for key in ("compute_s", "overhead_s", "fsdp_s", "tp_s", "sp_s"))
        print(f"| {row['layout']} | {row['workload']} | {row['train_s']:.2f} | {t['total_s']:.2f} ({parts}) | "
              f"{row['train_s'] / t['total_s']:.2f} | {row['log_prob_s']:.2f} | {lp['total_s']:.2f} | "
              f"{row['log_prob_s'] / lp['total_s']:.2f} | {row['saved'] / 2**20:.1f} / "
              f"{m['activations'] / 2**20:.1f} | "
              f"{row['peak'] / 2**20:.0f} / {m['total'] / 2**20:.0f} | {row['load']:.1f} |")


# ----------------------------------------------------------------------------------------------- GPU clusters
#: Assumptions, not measurements: H100 SXM bf16 dense peak 989 TFLOP/s at 40% MFU; NVLink ~450 GB/s per direction
#: within a node of 8, ~50 GB/s per GPU across nodes (400 Gb/s InfiniBand); 80 GB; causal flash attention.
H100 = Hardware(flops=0.40 * 989e12, bandwidth=450e9, latency=10e-6, memory=80e9, value_bytes=2, causal_fraction=0.5,
                overlap_fsdp=True, devices_per_node=8, inter_bandwidth=50e9, inter_latency=20e-6)
HBM_BANDWIDTH = 0.6 * 3.35e12
"""Assumed achieved HBM read rate of an H100 SXM (60% of 3.35 TB/s) for decoding."""
USABLE_MEMORY = 0.9
"""Share of device memory the model's parts may fill (the rest: CUDA context, NCCL buffers, fragmentation)."""

LLAMA_LIKE = {  # shapes of Mistral-7B, Qwen2.5-32B and Llama-3-70B
    "7B": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=32000),
    "32B": ModelShape(hidden=5120, layers=64, heads=40, kv_heads=8, intermediate=27648, vocab=152064),
    "70B": ModelShape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256),
}


@dataclass(frozen=True)
class RLStep:
    """One GRPO/PPO step of the hybrid engine: generate, two log-prob passes (old policy, reference), one update."""

    prompts: int = 512
    samples: int = 8
    prompt_len: int = 1024
    response_len: int = 4096
    log_prob_passes: int = 2
    checkpointing: bool = True


def layout_refusal(shape: ModelShape, layout: Layout, devices_per_node: int) -> str | None:
    """Why the engine refuses `layout` for `shape` (None: it takes it); tp and sp stay inside one node."""
    if layout.tp > 1 and layout.sp > 1:
        return "tp x sp is not implemented"
    if layout.tp * layout.sp > devices_per_node:
        return "tp/sp group larger than a node"
    tp_sizes = (shape.heads, shape.kv_heads, shape.intermediate, shape.vocab)
    if layout.tp > 1 and any(size % layout.tp for size in tp_sizes):
        return "tp does not divide heads / kv heads / MLP / vocab"
    if layout.sp > 1 and any(size % layout.sp for size in (shape.heads, shape.kv_heads)):
        return "sp does not divide heads / kv heads"
    return None


def estimate_rollout(shape: ModelShape, devices: int, tp: int, step: RLStep, hardware: Hardware,
                     resident_bytes: float) -> dict[str, float]:
    """Generation on `devices` / tp rollout replicas: memory-bound decoding (weights + KV cache read per token at
    HBM_BANDWIDTH, or 2 x params FLOPs per sequence if slower), in waves when the KV cache cannot hold every
    sequence of a replica at full length; prefill at the achieved FLOP rate. Rough: no long tail, no speculation."""
    params, seq_len = compute_params(shape), step.prompt_len + step.response_len
    sequences = step.prompts * step.samples * tp / devices
    weights = 2 * params / tp
    room = USABLE_MEMORY * hardware.memory - resident_bytes - weights
    per_sequence = compute_kv_cache_bytes(shape, seq_len, tp)
    batch = min(sequences, math.floor(max(room, 0.0) / per_sequence))
    if batch < 1:
        return {"fits": 0.0, "kv_bytes": 0.0, "gen_s": math.inf, "batch": 0.0}
    mean_context = step.prompt_len + step.response_len / 2
    read = weights + batch * compute_kv_cache_bytes(shape, mean_context, tp)
    per_token = max(read / HBM_BANDWIDTH, 2 * params / tp * batch / hardware.flops)
    per_token += (2 * shape.layers + 1) * compute_collective_seconds(
        "all_reduce", batch * shape.hidden * 2, tp, hardware.bandwidth, hardware.latency)
    prefill = 2 * params * step.prompts * step.samples * step.prompt_len / (devices * hardware.flops)
    waves = math.ceil(sequences / batch)
    return {"fits": 1.0, "kv_bytes": batch * per_sequence, "gen_s": waves * step.response_len * per_token + prefill,
            "batch": float(batch)}


def rank_layouts(shape: ModelShape, devices: int, step: RLStep, hardware: Hardware,
                 activation_factor: float) -> list[dict]:
    """Every dp x tp x sp layout of `devices` with the largest micro-batch (whole sequences, up to 32 per data-parallel
    group) that fits: its update and log-prob seconds and peak memory, fastest first; refused or non-fitting layouts
    last, with the reason."""
    seq_len, params = step.prompt_len + step.response_len, compute_params(shape)
    ref_bytes = 2 * params / devices  # the reference policy, bf16, sharded over every rank
    rows = []
    for tp in (1, 2, 4, 8):
        for sp in (1, 2, 4, 8):
            if devices % (tp * sp):
                continue
            layout = Layout(dp=devices // (tp * sp), tp=tp, sp=sp)
            row = {"layout": layout, "reason": layout_refusal(shape, layout, hardware.devices_per_node)}
            rows.append(row)
            if row["reason"]:
                continue
            for rows_per_micro in (32, 16, 8, 4, 2, 1):
                workload = Workload(step.prompts * step.samples, seq_len, step.response_len, rows_per_micro * seq_len)
                memory = estimate_memory(shape, layout, workload, hardware, activation_factor=activation_factor,
                                         checkpointing=step.checkpointing, extra_bytes=ref_bytes)
                if memory["total"] <= USABLE_MEMORY * hardware.memory:
                    break
            else:
                row["reason"] = f"does not fit: {memory['total'] / 1e9:.0f} GB at one sequence per micro-batch"
                row["memory"] = memory
                continue
            update = estimate_pass(shape, layout, workload, hardware, train=True, checkpointing=step.checkpointing)
            log_prob = estimate_pass(shape, layout, workload, hardware, train=False)
            row.update(workload=workload, memory=memory, update=update, log_prob=log_prob,
                       train_s=update["total_s"] + step.log_prob_passes * log_prob["total_s"])
    return sorted(rows, key=lambda row: (row["reason"] is not None, row.get("train_s", math.inf)))


def pick_rollout(shape: ModelShape, devices: int, step: RLStep, hardware: Hardware) -> dict:
    """The rollout tensor-parallel size with the fastest generation; the actor's fp32 weights and AdamW moments and
    the bf16 reference stay on the GPU during generation unless that leaves no room (then they are offloaded)."""
    params, best = compute_params(shape), None
    for offload in (False, True):
        resident = (0.0 if offload else 12 * params / devices) + 2 * params / devices
        for tp in (1, 2, 4, 8):
            refused = layout_refusal(shape, Layout(dp=max(1, devices // tp), tp=tp), hardware.devices_per_node)
            if refused or devices % tp:
                continue
            rollout = estimate_rollout(shape, devices, tp, step, hardware, resident)
            if rollout["fits"] and (best is None or rollout["gen_s"] < best["gen_s"]):
                best = {**rollout, "tp": tp, "offload": offload}
        if best is not None:
            return best
    return {"tp": 0, "offload": True, "gen_s": math.inf, "kv_bytes": 0.0, "batch": 0.0, "fits": 0.0}


def _describe(layout: Layout) -> str:
    return f"dp={layout.dp} tp={layout.tp} sp={layout.sp}"


def print_recommendations(step: RLStep, hardware: Hardware, activation_factor: float, detail: list[str]) -> None:
    print(f"assumed GPU constants (not measurements): {hardware.flops / 1e12:.0f} TFLOP/s achieved per GPU (40% of 989 "
          f"bf16 dense), {hardware.bandwidth / 1e9:.0f} GB/s within a node of {hardware.devices_per_node}, "
          f"{hardware.inter_bandwidth / 1e9:.0f} GB/s per GPU across nodes, {hardware.memory / 1e9:.0f} GB "
          f"({USABLE_MEMORY:.0%} usable), HBM {HBM_BANDWIDTH / 1e12:.1f} TB/s achieved in decoding; activation factor "
          f"{activation_factor:.2f}; step: {step.prompts} prompts x {step.samples} samples, {step.prompt_len} + "
          f"{step.response_len} tokens, {step.log_prob_passes} log-prob passes + 1 update, activation checkpointing "
          f"{'on' if step.checkpointing else 'off'}")
    for name, shape in LLAMA_LIKE.items():
        print(f"{name}: hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / {shape.kv_heads} kv heads, "
              f"MLP {shape.intermediate}, vocab {shape.vocab}: {compute_params(shape) / 1e9:.2f}B parameters")
    print("| model | GPUs | training layout | rows / micro-batch | peak GB | update s (compute, fsdp, tp, sp) | "
          "log-prob s "
          "| rollout tp | KV cache GB | generation s | step s | runner-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, shape in LLAMA_LIKE.items():
        for devices in (8, 16, 32, 64):
            ranked = rank_layouts(shape, devices, step, hardware, activation_factor)
            best, rollout = ranked[0], pick_rollout(shape, devices, step, hardware)
            if best["reason"]:
                print(f"| {name} | {devices} | none fits ({best['reason']}) | | | | | | | | | |")
                continue
            u = best["update"]
            runner = ranked[1]
            other = (f"{_describe(runner['layout'])}: {runner['reason']}" if runner["reason"] else
                     f"{_describe(runner['layout'])}: {runner['train_s'] / best['train_s']:.2f}x the training time")
            step_s = rollout["gen_s"] + best["train_s"]
            rows = best["workload"].micro_batch_tokens // best["workload"].seq_len
            print(f"| {name} | {devices} | {_describe(best['layout'])} | {rows} | "
                  f"{best['memory']['total'] / 1e9:.0f} | {u['total_s']:.0f} ({u['compute_s']:.0f}, {u['fsdp_s']:.0f}, "
                  f"{u['tp_s']:.1f}, {u['sp_s']:.1f}) | {best['log_prob']['total_s']:.0f} | {rollout['tp']}"
                  f"{' (actor offloaded)' if rollout['offload'] else ''} | {rollout['kv_bytes'] / 1e9:.0f} | "
                  f"{rollout['gen_s']:.0f} | {step_s:.0f} | {other} |")
    for item in detail:
        name, devices = item.split(":")
        print(f"\nevery layout, {name} on {devices} GPUs:")
        print("| layout | rows / micro-batch | peak GB (state, gathered, activations, logits) | update s | compute s | "
              "fsdp s (hidden if < compute) | tp s | sp s | log-prob s | note |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in rank_layouts(LLAMA_LIKE[name], int(devices), step, hardware, activation_factor):
            if "update" not in row:
                memory = row.get("memory")
                peak = f"{memory['total'] / 1e9:.0f}" if memory else ""
                print(f"| {_describe(row['layout'])} | | {peak} | | | | | | | {row['reason']} |")
                continue
            m, u = row["memory"], row["update"]
            print(f"| {_describe(row['layout'])} | {row['workload'].micro_batch_tokens // row['workload'].seq_len} | "
                  f"{m['total'] / 1e9:.0f} ({m['state'] / 1e9:.0f}, {m['gathered'] / 1e9:.1f}, "
                  f"{m['activations'] / 1e9:.0f}, {m['logits'] / 1e9:.0f}) | {u['total_s']:.0f} | "
                  f"{u['compute_s']:.0f} | "
                  f"{u['fsdp_s']:.0f} | {u['tp_s']:.1f} | {u['sp_s']:.1f} | {row['log_prob']['total_s']:.0f} | |")


DEFAULT_ACTIVATION_FACTOR = 1.16
"""Activation factor used without `--measured`: what autograd saved in a 1-worker micro-batch of the benchmark's
model over what `compute_activation_values` counts (fp32 on this CPU, 2026-11-25; docs/parallelism.md)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", help="JSON written by benchmarks/parallel_layouts.py --out: fit and check")
    parser.add_argument("--activation-factor", type=float, help="override the activation factor for the GPU tables")
    parser.add_argument("--detail", default="7B:8,70B:32",
                        help="comma-separated MODEL:GPUS cases to list every layout of")
    parser.add_argument("--prompts", type=int, default=RLStep.prompts)
    parser.add_argument("--samples", type=int, default=RLStep.samples)
    parser.add_argument("--prompt-len", type=int, default=RLStep.prompt_len)
    parser.add_argument("--response-len", type=int, default=RLStep.response_len)
    args = parser.parse_args()
    factor = DEFAULT_ACTIVATION_FACTOR
    if args.measured:
        results = json.loads(Path(args.measured).read_text())
        fitted = fit_cpu(results)
        print_cpu_check(results, fitted)
        factor = fitted["activation_factor"]
        print()
    if args.activation_factor is not None:
        factor = args.activation_factor
    step = RLStep(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                  response_len=args.response_len)
    print_recommendations(step, H100, factor, [d for d in args.detail.split(",") if d])


if __name__ == "__main__":
    main()
