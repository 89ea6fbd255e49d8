"""The `data.*` sections of the RL and SFT trainers (verl's keys), read directly by the datasets and loaders.

`DataFilesConfig` holds what both share (files, sample limits, order, chat-template arguments);
`RLHFDataConfig` adds prompts and lengths for RL, `SFTDataConfig` prompt/response columns for SFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, check_positive, unsupported

__all__ = ["CustomDatasetClassConfig", "DataFilesConfig", "MultiturnConfig", "RLHFDataConfig", "SFTDataConfig", "expand_path"]

_TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "tokenize")


def expand_path(path: str) -> Path:
    """A config path as every loader opens it: `~` expanded."""
    return Path(path).expanduser()


@dataclass(frozen=True, kw_only=True)
class CustomDatasetClassConfig:
    """A user's dataset class (verl's `data.custom_cls.*`), loaded from a Python file."""

    path: Optional[str] = None
    """Python file defining the class (`~` is expanded); None uses hybridflow.data.RLHFDataset."""
    name: Optional[str] = None
    """The class's name in that file. It must subclass torch.utils.data.Dataset and take RLHFDataset's arguments
    (data_files, tokenizer, config, max_samples, processor) and give its items (subclass RLHFDataset to change
    how rows become prompts)."""

    def __post_init__(self) -> None:
        if (self.path is None) != (self.name is None):
            raise ConfigFieldError(
                "path" if self.path is None else "name",
                f"path={self.path!r} and name={self.name!r}: a custom dataset class needs both (the file and the "
                "class in it), or neither",
            )


@dataclass(frozen=True, kw_only=True)
class DataFilesConfig:
    """Where the samples come from and in which order."""

    train_files: list[str] = field(default_factory=list)
    """Parquet files of training rows; one path or a list (`~` is expanded)."""
    val_files: Optional[list[str]] = field(default_factory=list)
    """Parquet files for validation; empty or null (verl's engine-SFT default) disables validation."""
    train_max_samples: int = -1
    """Use at most this many training rows (the first ones); -1 uses all."""
    val_max_samples: int = -1
    """Use at most this many validation rows; -1 uses all."""
    shuffle: bool = True
    """Shuffle training rows (seeded, resumable)."""
    seed: int | None = 1
    """Seed of the data order. null (verl's default): a seed is drawn from the OS's entropy when the run starts,
    logged, and saved with the sampler's state in each checkpoint, so a resumed run continues the same order."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for tokenizer.apply_chat_template (e.g. {enable_thinking: false})."""

    def named_files(self) -> list[tuple[str, str]]:
        """(its key, path) of every data file, the training files first: ('data.train_files', 'a.parquet'), ..."""
        return [*(("data.train_files", path) for path in self.train_files),
                *(("data.val_files", path) for path in self.val_files)]

    def __post_init__(self) -> None:
        if self.val_files is None:
            object.__setattr__(self, "val_files", [])
        check_literal_fields(self)
        check_at_least("train_max_samples", self.train_max_samples, -1, "-1 uses all rows")
        check_at_least("val_max_samples", self.val_max_samples, -1, "-1 uses all rows")
        if self.train_max_samples == 0 or self.val_max_samples == 0:
            raise ConfigFieldError("train_max_samples", "train_max_samples/val_max_samples=0 would leave no rows; use -1")
        clash = sorted(set(_TEMPLATE_RESERVED) & set(self.apply_chat_template_kwargs))
        if clash:
            raise ConfigFieldError(
                "apply_chat_template_kwargs", f"apply_chat_template_kwargs may not set {clash}: the dataset sets them"
            )


@dataclass(frozen=True, kw_only=True)
class DataSamplerConfig:
    """verl's `data.sampler.*`: a sampler class of the user's (a curriculum), built over the training set instead of
    hybridflow's seeded shuffle (`hybridflow.data.custom_sampler`)."""

    class_path: Optional[str] = None
    """The Python file defining it, or pkg://package.module for an importable module."""
    class_name: Optional[str] = None
    """The class: a torch Sampler built as `cls(data_source=dataset, data_config=data section)`; with an
    `update(batch)` method it is handed each trained batch (verl's AbstractCurriculumSampler)."""

    def __post_init__(self) -> None:
        if (self.class_path is None) != (self.class_name is None):
            raise ConfigFieldError("class_path", f"class_path={self.class_path!r} and class_name={self.class_name!r}: "
                                                 "set both (the file or pkg:// module, and the class in it) or neither")


@dataclass(frozen=True, kw_only=True)
class DataGenConfig:
    """verl's `data.datagen.*`: a dataset that makes new prompts during training."""

    path: Optional[str] = unsupported(None, "the prompts are the data files' rows, fixed at the start")
    """verl: the file defining it."""
    name: Optional[str] = unsupported(None, "the prompts are the data files' rows, fixed at the start")
    """verl: its class."""


@dataclass(frozen=True, kw_only=True)
class RLHFDataConfig(DataFilesConfig):
    """RL prompts (verl's parquet schema: prompt, data_source, reward_model.ground_truth) and lengths."""

    prompt_key: str = "prompt"
    """Column holding the chat messages (a list of {role, content})."""
    reward_fn_key: str = "data_source"
    """Column that picks each row's reward scorer."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template; prompts are left-padded to this length."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per training step (each is sampled actor_rollout_ref.rollout.n times)."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation batch when algorithm.filter_groups is on (DAPO draws more than it trains on); None:
    train_batch_size."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation batch; None takes the whole validation set at once."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """A prompt longer than max_prompt_length that was not filtered: error (names the row) | left (keep the
    last tokens) | right (keep the first) | middle (keep both ends)."""
    filter_overlong_prompts: bool = True
    """Drop over-long prompts when the dataset is built (one warning with the count)."""
    filter_overlong_prompts_workers: int = 1
    """Processes that measure the prompts' lengths for filter_overlong_prompts / truncation='error' (forked from the
    driver, or from a fork server where it is already connected to Ray; at most its CPU count; up to 1024 prompts
    are measured in the driver)."""
    return_raw_chat: bool = False
    """Keep the chat messages per sample as raw_prompt (agent loops need them)."""
    trust_remote_code: bool = False
    """Run the model repository's own code for the tokenizer and processor that prepare the prompts (verl's key;
    actor_rollout_ref.model.trust_remote_code allows it too)."""
    custom_cls: CustomDatasetClassConfig = field(default_factory=CustomDatasetClassConfig)
    """A dataset class of your own instead of RLHFDataset (verl's key)."""
    image_key: str = "images"
    """Column of each row's images (a list of {bytes} / {path} dicts or paths), one `<image>` placeholder in the
    prompt per image; read with a vision-language model's processor."""
    video_key: str = "videos"
    """Column of each row's videos; rows with videos are refused (images only)."""
    tokenizer: Optional[str] = unsupported(None, "the tokenizer is actor_rollout_ref.model.tokenizer_path")
    """Tokenizer of the dataset."""
    dataloader_num_workers: int = unsupported(0, "prompts are tokenized up front; loader workers would break resume")
    """Worker processes of the data loader."""
    validation_shuffle: bool = False
    """Shuffle the validation prompts (seeded by data.seed) before they are cut into val_batch_size batches; every
    one is still scored once."""
    tool_config_path: Optional[str] = None
    """verl: the tools whose schemas the dataset renders into each prompt (its default is
    rollout.multi_turn.tool_config_path). The tool agent loop renders each prompt with the tools of
    rollout.multi_turn.tool_config_path itself: None or that same file."""
    return_raw_input_ids: bool = unsupported(
        False, "a reward model with another tokenizer re-templates each conversation from raw_prompt itself"
    )
    """verl: keep each prompt's ids without padding for a reward model of another tokenizer."""
    return_full_prompt: bool = unsupported(False, "rows keep raw_prompt (return_raw_chat), not the templated text")
    """verl: keep each prompt's templated text."""
    return_multi_modal_inputs: bool = unsupported(
        True, "a vision-language model's rows always carry their processed images (multi_modal_inputs)"
    )
    """verl: keep the processor's outputs per row."""
    image_patch_size: int = unsupported(14, "images are resized by the model's own processor")
    """verl: the patch size qwen-vl-utils resizes images to."""
    use_shm: bool = unsupported(False, "data files are read from their paths (actor_rollout_ref.model.use_shm copies "
                                "the checkpoint, not data)")
    """verl: copy the data files to shared memory."""
    sampler: DataSamplerConfig = field(default_factory=lambda: DataSamplerConfig())
    """verl: a curriculum sampler class of your own."""
    datagen: DataGenConfig = field(default_factory=lambda: DataGenConfig())
    """verl: a dataset that generates new prompts during training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prompt_key:
            raise ConfigFieldError("prompt_key", "prompt_key must name a column, got an empty string")
        check_positive("max_prompt_length", self.max_prompt_length)
        check_positive("filter_overlong_prompts_workers", self.filter_overlong_prompts_workers)
        check_positive("max_response_length", self.max_response_length)
        check_positive("train_batch_size", self.train_batch_size)
        check_positive("gen_batch_size", self.gen_batch_size, allow_none=True)
        check_positive("val_batch_size", self.val_batch_size, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class MultiturnConfig:
    """Whole conversations instead of prompt/response pairs (SFT)."""

    enable: bool = False
    """Read conversations from messages_key; the loss covers assistant turns only."""
    messages_key: str = "messages"
    """Column of the conversation (a list of {role, content})."""
    tools_key: str = "tools"
    """Optional column of tool schemas passed to the chat template."""
    enable_thinking_key: str = "enable_thinking"
    """Optional column of per-row booleans passed to the chat template as enable_thinking (a null row leaves
    data.apply_chat_template_kwargs as set)."""


@dataclass(frozen=True, kw_only=True)
class SFTDatasetClassConfig:
    """verl's SFT `data.custom_cls.*`."""

    path: Optional[str] = unsupported(None, "SFT reads the prompt/response or messages columns itself")
    """verl: the file defining a dataset class."""
    name: Optional[str] = unsupported(None, "SFT reads the prompt/response or messages columns itself")
    """verl: the class."""


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig(DataFilesConfig):
    """SFT samples and batch sizes (verl's SFT `data.*` keys)."""

    prompt_key: str = "prompt"
    """Single-turn: column of the prompt (a string, or chat messages)."""
    response_key: str = "response"
    """Single-turn: column of the response (a string)."""
    prompt_dict_keys: list[str] = field(default_factory=list)
    """Keys to descend into when the prompt column holds dicts (e.g. [question] for prompt_key=extra_info)."""
    response_dict_keys: list[str] = field(default_factory=list)
    """Keys to descend into when the response column holds dicts."""
    multiturn: MultiturnConfig = field(default_factory=MultiturnConfig)
    """Multi-turn conversations."""
    max_length: int = 1024
    """Most tokens per sample after the chat template."""
    truncation: Literal["error", "left", "right"] = "error"
    """Longer samples: error (names the row) | left (keep the last tokens) | right (keep the first)."""
    train_batch_size: int = 256
    """Samples per optimizer step, over all ranks."""
    micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank (gradient accumulation fills the batch); also the eval batch."""
    micro_batch_size: Optional[int] = None
    """verl's old global form of micro_batch_size_per_gpu (its sp2 examples set it): given, micro_batch_size_per_gpu
    becomes it over the data-parallel ranks (ranks / (tensor x sequence parallel size)), floored, and this key
    reads back None. Both given is refused."""
    use_dynamic_bsz: bool = False
    """Cut each rank's share of a step into micro-batches by token count (max_token_len_per_gpu) instead of
    micro_batch_size_per_gpu rows (verl's engine-SFT key): short samples share a forward, long ones get their own.
    The loss is the same (a mean over the step's tokens); every rank runs as many micro-batches as the fullest."""
    max_token_len_per_gpu: int = 8192
    """With use_dynamic_bsz: real (unpadded) tokens per micro-batch on one rank, at least max_length; also the
    validation forwards' budget."""
    pad_mode: Literal["right", "no_padding"] = "right"
    """verl's engine-SFT batch layout. right: samples right-padded to the longest of the batch (the forward packs
    them when model.use_remove_padding). no_padding: the padding is never computed on: needs
    model.use_remove_padding=True, whose packed forward drops it."""
    ignore_input_ids_mismatch: bool = False
    """Multi-turn samples are tokenized message by message (for exact loss masks); when that differs from the whole
    conversation's tokenization (a merge across a turn boundary) the row is refused, naming it, unless this is
    True: then the message-by-message ids are trained on (verl's key and behaviour)."""
    balance_dp_token: bool = unsupported(False, "samples are split over the ranks by count (verl: not implemented)")
    """verl: balance tokens over data-parallel ranks."""
    use_shm: bool = unsupported(False, "the data files are read where they are")
    """verl: copy the data files to shared memory first."""
    chat_template: Optional[str] = unsupported(None, "set model.custom_chat_template")
    """verl: an old place of the chat template."""
    custom_cls: SFTDatasetClassConfig = field(default_factory=lambda: SFTDatasetClassConfig())
    """verl: a dataset class of the user's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("train_batch_size", self.train_batch_size)
        check_positive("micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        check_at_least("max_length", self.max_length, 2)
        check_positive("max_token_len_per_gpu", self.max_token_len_per_gpu)
        check_literal_fields(self)
        if self.use_dynamic_bsz and self.max_token_len_per_gpu < self.max_length:
            raise ConfigFieldError(
                "max_token_len_per_gpu",
                f"max_token_len_per_gpu={self.max_token_len_per_gpu} is below max_length={self.max_length}: a "
                "sample of max_length tokens would not fit a micro-batch; raise it",
            )
        keys = (self.multiturn.messages_key,) if self.multiturn.enable else (self.prompt_key, self.response_key)
        if not all(keys):
            name = "multiturn.messages_key" if self.multiturn.enable else "prompt_key/response_key"
            raise ConfigFieldError(name, f"{name} must name columns, got {keys}")

    @property
    def token_budget(self) -> Optional[int]:
        """Tokens per micro-batch on one rank, or None to cut by rows."""
        return self.max_token_len_per_gpu if self.use_dynamic_bsz else None
