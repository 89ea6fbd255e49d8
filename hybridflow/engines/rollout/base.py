"""The rollout interface every generation backend implements, and its sampling parameters.

A rollout turns a batch of left-padded prompts into a batch of prompt+response sequences (verl's layout):

    prompts      (bs, prompt_len)    the prompt ids, left-padded
    responses    (bs, response_len)  generated ids, right-padded with the pad id after the first eos
    input_ids    (bs, prompt_len + response_len)
    attention_mask, position_ids     same shape as input_ids; response positions continue the prompt's
    response_mask (bs, response_len) 1 up to and including the first eos, 0 after (agent loops: 1 on model
                                     tokens only; tool/user tokens have attention 1 and response_mask 0)
    rollout_log_probs (bs, response_len)  log-prob of each sampled token under softmax(logits / temperature),
                                     0 where response_mask is 0

`hybridflow.engines.rollout.output.build_rollout_output` assembles it, for every backend and the agent loops.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridflow.engines.rollout.config import SamplingConfig
from hybridflow.models.loader import resolve_dtype
from hybridflow.protocol import DataProto
from hybridflow.utils.device import release_freed_host_memory

Fingerprint = tuple[tuple[int, ...], torch.dtype, "float | None"]
"""A parameter's (shape, dtype, float32 sum or None): what a weight-delivery check compares."""


def tensor_sum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """Sum of `tensor` (cast to `dtype` first, the serving side's, when given), accumulated in float32: float64 sums
    cost 30x more on CPUs (1.4 s vs 0.05 s for SmolLM2's embedding, measured), and both sides of a hand-over sum the
    same values the same way."""
    tensor = tensor.detach()
    return float((tensor if dtype is None else tensor.to(dtype)).sum(dtype=torch.float32))

OVERRIDABLE_KEYS = ("do_sample", "temperature", "top_p", "top_k", "n", "max_new_tokens", "stop_token_ids")
"""Keys of `prompts.meta_info` that override the rollout's sampling parameters for one call."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingConfig):
    """One generation call's sampling: `SamplingConfig`'s fields plus the length limit and stop tokens.

    Greedy calls (`SamplingConfig.is_greedy`) are normalised to `do_sample=False`, so a backend only reads
    `do_sample`; their log-probs are reported at temperature 1 (`log_prob_temperature`), as the trainer's are.
    """

    max_new_tokens: int = 256
    """Maximum response length (verl's `rollout.response_length`); responses are right-padded to it."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response like eos (the tokenizer's eos always does)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.is_greedy and self.do_sample:
            object.__setattr__(self, "do_sample", False)  # temperature 0 is verl's way of asking for greedy

    @classmethod
    def from_config(cls, config: SamplingConfig, max_new_tokens: int, n: int = 1) -> SamplingParams:
        """The call parameters of a rollout or validation config; `n` defaults to 1 because the trainer
        repeats each prompt `config.n` times itself (one uid per prompt, as verl does)."""
        return cls(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            n=n,
            do_sample=config.do_sample,
            max_new_tokens=max_new_tokens,
        )

    def as_overrides(self) -> dict[str, Any]:
        """These parameters as `meta_info` overrides: `base.with_overrides(p.as_overrides()) == p` for any base."""
        return {key: getattr(self, key) for key in OVERRIDABLE_KEYS}

    def greedy(self) -> SamplingParams:
        """The same parameters with greedy decoding and one response per prompt (validation)."""
        return dataclasses.replace(self, do_sample=False, n=1)

    def with_overrides(self, meta_info: Mapping[str, Any]) -> SamplingParams:
        """Apply the `OVERRIDABLE_KEYS` found in `meta_info` (other keys are ignored)."""
        changes = {key: meta_info[key] for key in OVERRIDABLE_KEYS if key in meta_info}
        if "stop_token_ids" in changes:
            changes["stop_token_ids"] = tuple(changes["stop_token_ids"])
        return dataclasses.replace(self, **changes) if changes else self


class BaseRollout(abc.ABC):
    """A generation backend. Implementations register in `hybridflow.engines.rollout.ROLLOUTS`."""

    sampling_params: SamplingParams
    """Used for training rollouts."""
    val_sampling_params: SamplingParams
    """Used when `prompts.meta_info['validate']` is true."""

    holds_own_weights: ClassVar[bool] = False
    """True if the backend copies the weights it is given (e.g. into another engine), so a module shared with
    the trainer does not follow training: the actor then hands weights over before every generation."""
    runs_peft_modules: ClassVar[bool] = False
    """True if the backend generates with a peft-wrapped (LoRA) module as is, adapters active; otherwise a
    LoRA actor hands it merged weights (`FSDPEngine.named_full_params`) instead of sharing its module."""
    shares_training_weights: bool = False
    """Set by the worker when the rollout generates with the training engine's own module (one rank, no copy):
    `sleep` / `wake_up` then only free and restore caches and never move that module, which is being trained."""
    supports_streaming: ClassVar[bool] = False
    """True if the backend has `serve(source, params, max_len, max_seqs)`: requests join a decode that is
    already running (the generation server then uses it instead of one `generate_sequences` per batch)."""

    @classmethod
    def kwargs_from_config(cls, config: Any) -> dict[str, Any]:
        """Constructor arguments this backend takes from the rollout config section (`actor_rollout_ref.rollout`):
        the engine keys its `RolloutSpec.engine_keys` declares. None by default."""
        return {}

    def resolve_sampling_params(self, meta_info: Mapping[str, Any]) -> SamplingParams:
        """One call's parameters: the validation or training ones, with `meta_info`'s overrides applied."""
        base = self.val_sampling_params if meta_info.get("validate", False) else self.sampling_params
        return base.with_overrides(meta_info)

    @abc.abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate responses for left-padded `prompts` (`input_ids`, `attention_mask`, `position_ids`).

        `prompts.meta_info` may hold `validate` (use the validation sampling parameters) and per-call
        overrides (`OVERRIDABLE_KEYS`). Returns the layout in the module docstring, with non-tensor data and
        meta info carried over (rows repeated when n > 1).
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, one `(hf_name, full_tensor)` at a time (e.g. `engine.named_full_params()`)."""

    def named_weights(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters generation reads, by HF name (to check a weight sync), only those in `names` when given
        (a tensor-parallel engine then reassembles only them); backends that hold them in another engine do not
        expose them."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights")

    def weight_fingerprints(self, names: Collection[str] | None = None) -> dict[str, Fingerprint]:
        """`(shape, dtype, sum)` of the parameters generation reads, by HF name, computed where they live (to check a
        weight sync without moving them): `names` None gives every parameter without its sum (the layout), else the
        float32 sum of each named one. Default: from `named_weights()`; an engine that holds its weights elsewhere
        (vLLM) asks it."""
        wanted = None if names is None else set(names)
        return {
            name: (tuple(tensor.shape), tensor.dtype, None if wanted is None else tensor_sum(tensor))
            for name, tensor in self.named_weights(wanted)
        }

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release memory (weights, KV cache) until `wake_up`, so training can use it."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Undo `sleep`."""

    def wake_up_weights(self) -> None:
        """The first stage of a staged wake-up (`rollout.multi_stage_wake_up`): the weights only, so that a weight
        hand-over can follow before `wake_up` takes back the rest (the KV cache). Engines without a cache of their
        own between calls wake whole."""
        self.wake_up()


def place_rollout_model(
    model: torch.nn.Module | str | os.PathLike, dtype: str | torch.dtype
) -> tuple[torch.nn.Module, torch.device]:
    """The rollout's model on this rank's device in eval mode: `model` itself, or loaded from a catalogue
    name / directory / `.gguf` file in `dtype`."""
    from hybridflow.env import dist_local_rank
    from hybridflow.models.loader import build_causal_lm
    from hybridflow.utils.device import get_torch_device

    if isinstance(model, (str, os.PathLike)):
        model = build_causal_lm(model, dtype=dtype, attn_implementation=None)  # transformers' choice: sdpa or eager
    device = get_torch_device(dist_local_rank())
    return model.to(device).eval(), device


ABORTED = "abort"
"""The `finish_reason` of a request over-sampling ended (`GenerationServer.abort`, a continuous batcher's run)."""
ABORTED_ROWS_KEY = "__aborted__"
"""`non_tensor_batch` key of a generation with over-sampling: (rows,) bool, the rows it ended with no response."""


def completions_needed(num_rows: int, over_sample_rate: float) -> int:
    """Trajectories that must end before over-sampling aborts the rest: verl's int(N * (1 - over_sample_rate)), at
    least one; N (none aborted) at rate 0."""
    if over_sample_rate <= 0.0:
        return num_rows
    return max(1, int(num_rows * (1.0 - over_sample_rate)))


def rollout_engine_metrics(stats: dict | None) -> dict[str, float]:
    """A rollout's own figures for its last call (`last_stats`: the native engine's prefill and decode seconds,
    decode steps, CUDA graphs captured...) as `rollout/engine/<name>` metrics; numbers only."""
    return {
        f"rollout/engine/{name}": float(value)
        for name, value in (stats or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def compute_rollout_copy_dtype(
    setting: str | torch.dtype, device: torch.device, training_dtype: torch.dtype
) -> torch.dtype | None:
    """The dtype of the rollout's own copy of a one-rank trainer's module, or None to generate with that module.

    setting: `rollout.dtype` ('auto': bfloat16 on accelerators, float32 on CPU, `resolve_dtype`); training_dtype:
    the dtype of the trainer's parameters. The rollout shares the module when the trainer's weights already have
    the rollout dtype, else it takes a copy in the rollout dtype, refreshed by the weight hand-over before each
    generation: on an accelerator a trainer holding fp32 master weights would otherwise make generation run eager
    in fp32 (issue 25). On CPU 'auto' always shares the module (fp32 is the fast path there, and a bf16 trainer's
    own dtype serves too); a dtype set explicitly is honoured, as it is on more ranks.
    """
    if device.type == "cpu" and setting == "auto":
        return None
    dtype = resolve_dtype(setting, device)
    return None if dtype == training_dtype else dtype


def compute_empty_cache_on_sleep(device_type: str, shares_training_weights: bool) -> bool:
    """Whether a rollout's `sleep` gives the device allocator's cached blocks back to the device.

    Only when its own weights leave the device (an accelerator, weights not the trainer's). A rollout that shares
    the trainer's module frees at most its KV cache, whose blocks the trainer's next update reuses from the same
    process's caching allocator; emptying the cache would make that update allocate them again (issue 25).
    """
    return device_type != "cpu" and not shares_training_weights


def sleep_rollout_model(model: torch.nn.Module, device: torch.device, shares_training_weights: bool) -> None:
    """The weight half of a rollout's `sleep`: move its own weights to host memory and empty the device cache
    (`compute_empty_cache_on_sleep`); the trainer's own module stays as it is. On a CPU host the weights stay and
    the heap's freed pages (the KV cache's, the generation's) go back to the OS: without that a tool-agent run's
    processes kept 2.3-6 GB more resident after a generation (docs/performance.md)."""
    if device.type == "cpu":
        release_freed_host_memory()
        return
    if not compute_empty_cache_on_sleep(device.type, shares_training_weights):
        return
    model.to("cpu")
    torch.accelerator.empty_cache()


def wake_up_rollout_model(model: torch.nn.Module, device: torch.device, shares_training_weights: bool) -> None:
    """Undo `sleep_rollout_model`: move the rollout's own weights back to `device`."""
    if device.type != "cpu" and not shares_training_weights:
        model.to(device)


@torch.no_grad()
def copy_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each `(hf_name, tensor)` into `model`'s parameter or buffer of that name, in place (casting
    dtype/device); returns how many. KeyError for an unknown name, ValueError for a shape mismatch."""
    targets = model.state_dict(keep_vars=True)
    num_loaded = 0
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise KeyError(f"rollout model has no parameter or buffer named {name!r}")
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name!r}: rollout has {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.data.copy_(tensor)
        num_loaded += 1
    return num_loaded


@torch.no_grad()
def copy_buffers(target: torch.nn.Module, source: torch.nn.Module) -> int:
    """Copy every buffer of `source` into `target`'s buffer of the same name (casting dtype/device); returns how many.
    KeyError when `target` has a buffer that `source` lacks: it would stay uninitialised."""
    source_buffers = dict(source.named_buffers())
    num_copied = 0
    for name, buffer in target.named_buffers():
        if name not in source_buffers:
            raise KeyError(f"the source module has no buffer {name!r} to initialise the rollout's copy with")
        buffer.copy_(source_buffers[name])
        num_copied += 1
    return num_copied
