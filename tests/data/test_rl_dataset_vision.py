"""RLHFDataset with images (verl's multi-modal schema) and the tiny Qwen2-VL's processor; the color_square task."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from hybridflow.data import RLHFDataConfig, RLHFDataset, collate_fn
from hybridflow.data.preprocess import color_square
from hybridflow.models import build_causal_lm, load_tokenizer
from hybridflow.models.vision import load_processor
from hybridflow.protocol import DataProto
from hybridflow.rewards.score import default_compute_score


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    return build_causal_lm(tiny_vlm_dir).eval(), load_tokenizer(tiny_vlm_dir), load_processor(tiny_vlm_dir)


def png(size: tuple[int, int], color: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def image_row(content: str, images: list[Any] | None, index: int = 0) -> dict[str, Any]:
    row = {"data_source": "color_square", "prompt": [{"role": "user", "content": content}], "ability": "vision",
           "reward_model": {"style": "rule", "ground_truth": "red"}, "extra_info": {"index": index}}
    if images is not None:
        row["images"] = images
    return row


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_items_have_expanded_image_tokens_mrope_positions_and_multi_modal_fields(tmp_path, vlm):
    model, tokenizer, processor = vlm
    image_file = tmp_path / "wide.png"
    image_file.write_bytes(png((112, 56), "blue"))
    rows = [image_row("<image>What color is the square?", [{"bytes": png((56, 56), "red")}], index=7),
            image_row("Left <image> right <image> same?", [{"bytes": png((56, 56), "red"), "path": None},
                                                          {"bytes": None, "path": str(image_file)}])]
    dataset = RLHFDataset(write(tmp_path / "train.parquet", rows), tokenizer, RLHFDataConfig(max_prompt_length=48),
                          processor=processor)
    first, second = dataset[0], dataset[1]
    image_id = processor.image_token_id
    assert int((first["input_ids"] == image_id).sum()) == 4 and int((second["input_ids"] == image_id).sum()) == 4 + 8
    assert first["raw_prompt_ids"].count(image_id) == 1 and second["raw_prompt_ids"].count(image_id) == 2
    assert first["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert second["multi_modal_inputs"]["pixel_values"].shape == (16 + 32, 1176)
    assert [im.size for im in second["multi_modal_data"]["image"]] == [(56, 56), (112, 56)]
    assert "images" not in first and first["index"] == 7 and first["data_source"] == "color_square"
    as_paths = write(tmp_path / "paths.parquet", [image_row("<image>What?", [str(image_file)])])  # plain paths
    assert RLHFDataset(as_paths, tokenizer, RLHFDataConfig(max_prompt_length=48), processor=processor)[0][
        "multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 8]]

    batch = DataProto.from_single_dict(collate_fn([first, second]))
    position_ids = batch.batch["position_ids"]
    assert position_ids.shape == (2, 4, 48)
    mask = batch.batch["attention_mask"]
    assert torch.equal(position_ids[:, 0], torch.clamp(mask.cumsum(-1) - 1, min=0))  # row 0: text positions
    rows_inputs = batch.non_tensor_batch["multi_modal_inputs"]
    expected, _ = model.model.get_rope_index(
        batch.batch["input_ids"], mm_token_type_ids=(batch.batch["input_ids"] == image_id).int(),
        image_grid_thw=torch.cat([r["image_grid_thw"] for r in rows_inputs]), attention_mask=mask,
    )
    assert torch.equal(position_ids[:, 1:].transpose(0, 1), expected)


def test_color_square_task_writes_verl_schema_and_scores_exact_color(tmp_path, vlm):
    _, tokenizer, processor = vlm
    color_square.main(["--local_dir", str(tmp_path), "--train_size", "6", "--test_size", "2", "--seed", "3"])
    table = pq.read_table(tmp_path / "train.parquet")
    assert {"prompt", "images", "data_source", "reward_model", "extra_info"} <= set(table.column_names)
    row = table.to_pylist()[0]
    assert row["prompt"][0]["content"].startswith("<image>") and list(row["images"][0]) == ["bytes"]
    picture = Image.open(io.BytesIO(row["images"][0]["bytes"]))
    assert picture.size == (56, 56)
    assert color_square.COLORS[row["reward_model"]["ground_truth"]] in {c for _, c in picture.getcolors()}
    dataset = RLHFDataset(tmp_path / "train.parquet", tokenizer, RLHFDataConfig(max_prompt_length=40),
                          processor=processor)
    assert len(dataset) == 6 and int((dataset[0]["input_ids"] == processor.image_token_id).sum()) == 4
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score("color_square", f" {truth.title()}.", truth) == 1.0
    assert default_compute_score("color_square", f"It is {truth}", truth) == 0.0


@pytest.mark.parametrize(("content", "images", "match"), [
    ("<image>What color?", [], r"row 0: column 'images' is missing or empty"),
    ("<image>What color?", None, r"row 0: column 'images' is missing or empty"),
    ("<image><image>What color?", "one", r"row 0: column 'prompt' has 2 <image> placeholder\(s\) but column "
                                          r"'images' has 1 image\(s\)"),
    ("What color?", "one", r"row 0: column 'prompt' has 0 <image> placeholder\(s\)"),
    ("<image>What color?", [{"size": 3}], r"row 0: column 'images'\[0\] must be a \{'bytes'"),
])
def test_malformed_image_rows_name_the_row_and_column(tmp_path, vlm, content, images, match):
    _, tokenizer, processor = vlm
    images = [{"bytes": png((56, 56), "red")}] if images == "one" else images
    path = write(tmp_path / "bad.parquet", [image_row(content, images)])
    with pytest.raises(ValueError, match=match):
        RLHFDataset(path, tokenizer, RLHFDataConfig(max_prompt_length=64), processor=processor)


def test_unreadable_image_bytes_overlong_prompts_videos_and_text_models_are_refused(tmp_path, vlm):
    _, tokenizer, processor = vlm
    garbage = write(tmp_path / "garbage.parquet", [image_row("<image>What?", [{"bytes": b"not a png"}])])
    with pytest.raises(ValueError, match=r"garbage.parquet: row 0: image 0: cannot read the image"):
        RLHFDataset(garbage, tokenizer, RLHFDataConfig(max_prompt_length=64), processor=processor)

    big = write(tmp_path / "big.parquet", [image_row("<image>What?", [{"bytes": png((112, 112), "red")}])])
    config = RLHFDataConfig(max_prompt_length=20, filter_overlong_prompts=False, truncation="left")
    dataset = RLHFDataset(big, tokenizer, config, processor=processor)
    with pytest.raises(ValueError, match=r"row 0: prompt has \d+ tokens \(image tokens included\) > "
                                         r"data.max_prompt_length=20; prompts with images are never truncated"):
        dataset[0]
    with pytest.raises(ValueError, match="every prompt .* is longer than data.max_prompt_length=20"):
        RLHFDataset(big, tokenizer, RLHFDataConfig(max_prompt_length=20), processor=processor)

    video = image_row("<image>What?", [{"bytes": png((56, 56), "red")}])
    video["videos"] = [{"path": "clip.mp4"}]
    path = write(tmp_path / "video.parquet", [video])
    with pytest.raises(ValueError, match=r"video.parquet: row 0: column 'videos' holds videos; hybridflow reads "
                                         "images only"):
        RLHFDataset(path, tokenizer, RLHFDataConfig(max_prompt_length=64), processor=processor)

    with pytest.raises(ValueError, match=r"row 0: column 'images' holds 1 image\(s\) but actor_rollout_ref.model.path "
                                         "is a text-only model"):
        RLHFDataset(big, tokenizer, RLHFDataConfig(max_prompt_length=64))  # no processor: a text model
