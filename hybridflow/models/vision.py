"""Vision-language models (Qwen2-VL family): recognising them, their processor, image tokens, M-RoPE position ids.

verl's multi-modal data path (`verl/utils/dataset/rl_dataset.py`, `verl/models/transformers/qwen2_vl.py`) needs
three things from a checkpoint besides the model: its image processor (pixels -> `pixel_values` patches and
`image_grid_thw`), its chat template (image entries -> `<|vision_start|><|image_pad|><|vision_end|>`), and the
rule that expands each `<|image_pad|>` to one token per merged patch. `VisionProcessor` composes the first two
from the checkpoint directory (`AutoImageProcessor`, the tokenizer, the processor's chat template) and applies
the third itself, as `Qwen2VLProcessor` does.

Why not `AutoProcessor`: transformers 5.23's `Qwen2VLProcessor` cannot be built without a video processor, which
needs torchvision; no torchvision wheel works with torch 2.13+cpu here (the PyPI build fails on import: "operator
torchvision::nms does not exist"). The image processor alone runs on PIL (`Qwen2VLImageProcessorPil`).

Position ids follow verl: one row per sample of shape (4, seq), the text positions (as for a text model) and
then the three M-RoPE rows (temporal, height, width) that the model's own `get_rope_index` computes; a batch
is (bs, 4, seq), transposed to (4, bs, seq) for the model, which reads row 0 as text positions.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SUPPORTED_VISION_MODEL_TYPES",
    "VisionProcessor",
    "check_vision_language_support",
    "compute_mrope_position_ids",
    "concat_multi_modal_inputs",
    "copy_image_processor",
    "is_vision_language_config",
    "load_processor",
    "multi_modal_model_inputs",
]

SUPPORTED_VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""Model types whose images arrive as flattened patches with `image_grid_thw` and whose positions are M-RoPE."""

IMAGE_TOKEN = "<|image_pad|>"


def is_vision_language_config(config: Any) -> bool:
    """Whether an HF config describes a vision-language model (it has a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
"""Attribute names of a vision-language model's vision tower (Qwen2-VL's `visual`), on the model or its `model`."""


def vision_tower_of(module: Any) -> Any:
    """The vision tower of an HF vision-language module (through a peft wrapper); ValueError when it has none."""
    for owner in (module, getattr(module, "model", None), getattr(getattr(module, "base_model", None), "model", None)):
        for holder in (owner, getattr(owner, "model", None)):
            for name in VISION_TOWER_NAMES:
                tower = getattr(holder, name, None) if holder is not None else None
                if tower is not None:
                    return tower
    raise ValueError(
        f"{type(module).__name__} has no vision tower ({' / '.join(VISION_TOWER_NAMES)}): freeze_vision_tower=True "
        "needs a vision-language model"
    )


def check_vision_language_support(config: Any, where: str) -> None:
    """ValueError naming `where` (a config key) if `config` is a vision-language model hybridflow cannot run."""
    model_type = getattr(config, "model_type", None)
    if is_vision_language_config(config) and model_type not in SUPPORTED_VISION_MODEL_TYPES:
        raise ValueError(
            f"{where}: vision-language model_type {model_type!r} is not supported; supported: "
            f"{list(SUPPORTED_VISION_MODEL_TYPES)} (images as patches with image_grid_thw, M-RoPE positions)"
        )


class VisionProcessor:
    """A Qwen2-VL-style checkpoint's image processor, tokenizer and chat template, images only.

    Args:
        image_processor: the checkpoint's `AutoImageProcessor` (has `merge_size`).
        tokenizer: knows `<|image_pad|>` (and the vision start/end tokens the template writes).
        chat_template: renders `{"type": "image"}` content entries; None: the tokenizer's.
    """

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.chat_template
        self.merge_size = int(image_processor.merge_size)
        self.image_token_id = _token_id(tokenizer, IMAGE_TOKEN)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer: Any = None,
                        trust_remote_code: bool = False) -> VisionProcessor:
        """Load the image processor and chat template from a checkpoint directory (`tokenizer`: its own)."""
        from transformers import AutoImageProcessor

        from hybridflow.models.loader import load_tokenizer

        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path, trust_remote_code=trust_remote_code)
        image_processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return cls(image_processor, tokenizer, _read_chat_template(Path(path)))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the image processor config and the tokenizer (with the chat template) into `path`."""
        self.image_processor.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """The prompt text of `messages` (content: a str, or a list of {"type": "text"|"image"} entries)."""
        return self.tokenizer.apply_chat_template(
            list(messages), chat_template=self.chat_template, tokenize=False, **kwargs
        )

    def num_image_tokens(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Tokens per image after the vision tower's patch merge: (num_images, 3) -> [t * h * w / merge^2, ...]."""
        return [int(n) for n in image_grid_thw.prod(-1) // self.merge_size**2]

    def __call__(self, text: str, images: Sequence[Any]) -> dict[str, Any]:
        """Tokenize `text` (rendered by `apply_chat_template`) and process `images` (PIL, in placeholder order).

        Returns `input_ids` (list[int]) with each `<|image_pad|>` expanded to its image's token count,
        `raw_prompt_ids` (list[int], not expanded: what an engine that expands images itself takes),
        `pixel_values` (num_patches, patch_dim) float32 and `image_grid_thw` (num_images, 3) int64.

        Raises:
            ValueError: the text holds a different number of image tokens than there are images.
        """
        raw_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        num_placeholders = sum(1 for token in raw_ids if token == self.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} image tokens but {len(images)} images")
        if not images:
            return {"input_ids": list(raw_ids), "raw_prompt_ids": list(raw_ids)}
        features = self.image_processor(images=list(images), return_tensors="pt")
        counts = iter(self.num_image_tokens(features["image_grid_thw"]))
        input_ids: list[int] = []
        for token in raw_ids:
            input_ids.extend([token] * next(counts) if token == self.image_token_id else [token])
        return {
            "input_ids": input_ids,
            "raw_prompt_ids": list(raw_ids),
            "pixel_values": features["pixel_values"],
            "image_grid_thw": features["image_grid_thw"].long(),
        }


def copy_image_processor(source: str | os.PathLike, target: str | os.PathLike) -> bool:
    """Copy a checkpoint's image-processor config (`preprocessor_config.json`) into `target` (a checkpoint's HF
    directory, so that an exported model loads with its processor); False when `source` has none (text models)."""
    config = Path(source) / "preprocessor_config.json"
    if not config.is_file():
        return False
    Path(target).mkdir(parents=True, exist_ok=True)
    shutil.copy2(config, Path(target) / config.name)
    return True


def load_processor(path: str | os.PathLike, tokenizer: Any = None, trust_remote_code: bool = False,
                   where: str = "actor_rollout_ref.model.path") -> VisionProcessor | None:
    """A `VisionProcessor` for a vision-language checkpoint, None for a text model (catalogue / GGUF included)."""
    from hybridflow.models.loader import load_model_config

    config = load_model_config(path, trust_remote_code=trust_remote_code)
    if not is_vision_language_config(config):
        return None
    check_vision_language_support(config, where)
    from hybridflow.models.catalogue import resolve_model_path

    return VisionProcessor.from_pretrained(resolve_model_path(path), tokenizer, trust_remote_code)


def compute_mrope_position_ids(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None, *,
    image_token_id: int, spatial_merge_size: int,
) -> torch.Tensor:
    """M-RoPE positions of one left-padded sequence, as Qwen2-VL's `get_rope_index` computes them (images only).

    Text tokens advance all three rows by one; an image's t*h*w merged tokens get (t, h, w) grid coordinates
    offset by the position where it starts, and the text after it starts at that offset + max(h, w).

    input_ids, attention_mask: (seq,) int; image_grid_thw: (num_images, 3) int64 or None -> (3, seq) int64,
    0 on padding.
    """
    valid = attention_mask.bool()
    ids = input_ids[valid].tolist()
    grids = image_grid_thw.tolist() if image_grid_thw is not None else []
    chunks: list[torch.Tensor] = []
    current, index, image_index = 0, 0, 0
    while index < len(ids):
        if ids[index] == image_token_id:
            if image_index >= len(grids):
                raise ValueError(f"more image tokens than the {len(grids)} images of image_grid_thw")
            t, h, w = grids[image_index]
            image_index += 1
            h, w = h // spatial_merge_size, w // spatial_merge_size
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            chunks.append(grid.reshape(3, -1) + current)
            current += max(h, w)
            index += t * h * w
        else:
            end = index
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            chunks.append(torch.arange(end - index).expand(3, -1) + current)
            current += end - index
            index = end
    if image_index != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images but the sequence holds {image_index}")
    positions = torch.zeros(3, input_ids.size(0), dtype=torch.long)
    if chunks:
        values = torch.cat(chunks, dim=1)
        if values.size(1) != len(ids):
            raise ValueError(f"an image's tokens are cut off: image_grid_thw needs {values.size(1)} positions, "
                             f"the sequence has {len(ids)}")
        positions[:, valid] = values
    return positions


def concat_multi_modal_inputs(rows: Sequence[Mapping[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """Per-row multi-modal inputs -> one dict for the model: each key's tensors concatenated in row order (as
    verl's `extract_multi_modal_inputs`); rows without images (None or {}) add nothing."""
    collected: dict[str, list[torch.Tensor]] = {}
    for row in rows:
        for key, value in (row or {}).items():
            collected.setdefault(key, []).append(value)
    return {key: torch.cat(values, dim=0) for key, values in collected.items()}


def multi_modal_model_inputs(
    rows: Sequence[Mapping[str, torch.Tensor] | None], input_ids: torch.Tensor, image_token_id: int | None = None
) -> dict[str, torch.Tensor]:
    """What a Qwen2-VL forward or `generate` takes besides ids and mask, for the rows of `input_ids` (bs, seq):
    the concatenated `pixel_values` / `image_grid_thw`, and `mm_token_type_ids` (bs, seq) (1 on image tokens)
    when `image_token_id` is given (generate computes M-RoPE from it)."""
    inputs = concat_multi_modal_inputs(rows)
    if inputs and image_token_id is not None:
        inputs["mm_token_type_ids"] = (input_ids == image_token_id).to(torch.int32)
    return inputs


def _token_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.get_vocab().get(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token!r} token: not a Qwen2-VL-style vision-language tokenizer")
    return int(token_id)


def _read_chat_template(directory: Path) -> str | None:
    """The processor's chat template saved in a checkpoint (chat_template.jinja, or chat_template.json's), if any."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    legacy = directory / "chat_template.json"
    if legacy.is_file():
        return json.loads(legacy.read_text()).get("chat_template")
    return None
