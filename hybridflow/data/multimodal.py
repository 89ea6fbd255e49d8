"""Image rows of an RL dataset (verl's multi-modal schema) -> processor inputs, prompt tensors and M-RoPE positions.

A row holds its images in the `images` column (`data.image_key`): a list of `{"bytes": ...}` dicts (what
`datasets.Image` and verl's `examples/data_preprocess/geo3k.py` write), `{"path": ...}` dicts or path strings.
The user message marks where each one goes with an `<image>` placeholder, in order; the placeholders become
`{"type": "image"}` entries of the message content, which the processor's chat template renders. Videos
(`data.video_key`) are refused.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridflow.models.vision import VisionProcessor, compute_mrope_position_ids

__all__ = [
    "IMAGE_PLACEHOLDER", "build_vision_messages", "check_vision_row", "decode_image", "encode_vision_prompt",
    "vision_prompt_length",
]

IMAGE_PLACEHOLDER = "<image>"


def check_vision_row(row: Mapping[str, Any], where: str, *, prompt_key: str, image_key: str, video_key: str,
                     has_processor: bool) -> None:
    """ValueError naming `where` (file and row) and the column if the row's images do not fit its prompt.

    Checks, without decoding any image: no videos; images only with a vision-language model; with one, at least
    one image, each a bytes/path dict or a path, and as many `<image>` placeholders in the messages as images.
    """
    videos = row.get(video_key)
    if videos is not None and len(videos):
        raise ValueError(f"{where}: column {video_key!r} holds videos; hybridflow reads images only (data.image_key)")
    images = row.get(image_key)
    images = [] if images is None else list(images)
    if images and not has_processor:
        raise ValueError(
            f"{where}: column {image_key!r} holds {len(images)} image(s) but actor_rollout_ref.model.path is a "
            "text-only model; use a vision-language model (e.g. Qwen2-VL) or drop the column"
        )
    if not has_processor:
        return
    if not images:
        raise ValueError(
            f"{where}: column {image_key!r} is missing or empty; every row of a vision-language dataset needs at "
            "least one image (text-only rows are not supported: the sharded vision tower must run on every rank)"
        )
    for position, image in enumerate(images):
        if not _is_image_reference(image):
            raise ValueError(
                f"{where}: column {image_key!r}[{position}] must be a {{'bytes': ...}} or {{'path': ...}} dict or a "
                f"path string, got {type(image).__name__}"
            )
    num_placeholders = sum(_content_text(m).count(IMAGE_PLACEHOLDER) for m in row[prompt_key])
    if num_placeholders != len(images):
        raise ValueError(
            f"{where}: column {prompt_key!r} has {num_placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but column "
            f"{image_key!r} has {len(images)} image(s); put one {IMAGE_PLACEHOLDER} where each image goes"
        )


def decode_image(value: Any, where: str) -> Any:
    """A `{"bytes": ...}` / `{"path": ...}` dict, a path string or a PIL image -> an RGB PIL image.

    Raises ValueError naming `where` when the bytes are not an image or the file cannot be read.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    try:
        if isinstance(value, Mapping) and value.get("bytes") is not None:
            image = Image.open(io.BytesIO(value["bytes"]))
        else:
            path = value.get("path") if isinstance(value, Mapping) else value
            image = Image.open(Path(str(path)).expanduser())
        image.load()
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"{where}: cannot read the image: {err}") from None
    return image.convert("RGB")


def build_vision_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages whose `<image>` placeholders become `{"type": "image"}` content entries (text around them
    becomes `{"type": "text"}` entries); messages without placeholders keep their string content."""
    built = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        content = message["content"]
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts = [part for part in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content) if part]
            message["content"] = [
                {"type": "image"} if part == IMAGE_PLACEHOLDER else {"type": "text", "text": part} for part in parts
            ]
        built.append(message)
    return built


def encode_vision_prompt(
    processor: VisionProcessor, messages: Sequence[Mapping[str, Any]], images: Sequence[Any], *,
    max_length: int, pad_token_id: int, where: str, chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One row's prompt tensors and multi-modal fields (verl's names).

    Returns `input_ids`, `attention_mask` (max_length,) int64 left-padded, `position_ids` (4, max_length) int64
    (text positions, then the M-RoPE rows), `raw_prompt_ids` (list[int], image tokens not expanded),
    `multi_modal_data` ({"image": [PIL images]}) and `multi_modal_inputs` ({"pixel_values", "image_grid_thw"}).

    Raises:
        ValueError: naming `where`, when the prompt with its image tokens is longer than `max_length` (image
            tokens cannot be truncated).
    """
    pictures = [decode_image(image, f"{where}: image {position}") for position, image in enumerate(images)]
    text = processor.apply_chat_template(
        build_vision_messages(messages), add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    encoded = processor(text, pictures)
    ids = encoded["input_ids"]
    if len(ids) > max_length:
        raise ValueError(
            f"{where}: prompt has {len(ids)} tokens (image tokens included) > data.max_prompt_length={max_length}; "
            "prompts with images are never truncated: raise data.max_prompt_length or set "
            "data.filter_overlong_prompts=True"
        )
    num_pad = max_length - len(ids)
    input_ids = torch.tensor([pad_token_id] * num_pad + ids, dtype=torch.long)
    attention_mask = torch.tensor([0] * num_pad + [1] * len(ids), dtype=torch.long)
    text_positions = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    mrope = compute_mrope_position_ids(
        input_ids, attention_mask, encoded["image_grid_thw"],
        image_token_id=processor.image_token_id, spatial_merge_size=processor.merge_size,
    )
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": torch.cat([text_positions.unsqueeze(0), mrope], dim=0),
        "raw_prompt_ids": encoded["raw_prompt_ids"],
        "multi_modal_data": {"image": pictures},
        "multi_modal_inputs": {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]},
    }


def vision_prompt_length(processor: VisionProcessor, messages: Sequence[Mapping[str, Any]], images: Sequence[Any],
                         where: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> int:
    """Tokens of a row's prompt with its image tokens expanded (what `max_prompt_length` is compared with)."""
    pictures = [decode_image(image, f"{where}: image {position}") for position, image in enumerate(images)]
    text = processor.apply_chat_template(
        build_vision_messages(messages), add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    return len(processor(text, pictures)["input_ids"])


def _is_image_reference(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, Mapping):
        return value.get("bytes") is not None or isinstance(value.get("path"), str)
    return type(value).__module__.startswith("PIL.")


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""
