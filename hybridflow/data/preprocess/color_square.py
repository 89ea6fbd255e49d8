"""Write train/test parquet files of a synthetic image task: "What color is the square?" (offline, PIL-drawn).

    python -m hybridflow.data.preprocess.color_square --local_dir ~/data/color_square \
        --train_size 512 --test_size 64 --seed 0 [--image_size 56]

Each image is a light-grey canvas with one filled square of a random colour, size and position. Rows follow
verl's multi-modal schema (as its `examples/data_preprocess/geo3k.py` writes): `images` is a list of one
`{"bytes": <PNG>}` dict, the user message starts with the `<image>` placeholder, data_source `color_square`,
`reward_model.ground_truth` the colour word (scored by exact match, `hybridflow.rewards.score.color_square`),
`extra_info` {split, index, color}.
"""

from __future__ import annotations

import argparse
import io
import logging
import random
from collections.abc import Sequence
from typing import Any

from hybridflow.data.preprocess.common import add_output_args, check_outputs_free, make_row, write_splits

__all__ = ["COLORS", "DATA_SOURCE", "QUESTION", "build_rows", "draw_square", "main"]

DATA_SOURCE = "color_square"
QUESTION = "<image>What color is the square? Answer with one word."
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "black": (10, 10, 10),
    "purple": (130, 40, 170),
}
"""Colour words and their RGB values (distinct from the grey background)."""


def draw_square(color: str, image_size: int, rng: random.Random) -> bytes:
    """A PNG (bytes) of an `image_size` square canvas with one filled `color` square at a random place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (image_size, image_size), (200, 200, 200))
    side = rng.randint(image_size // 4, image_size // 2)
    left, top = rng.randint(0, image_size - side), rng.randint(0, image_size - side)
    ImageDraw.Draw(image).rectangle((left, top, left + side - 1, top + side - 1), fill=COLORS[color])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def build_rows(train_size: int, test_size: int, seed: int, image_size: int = 56) -> dict[str, list[dict[str, Any]]]:
    """{'train': rows, 'test': rows}; the same seed gives the same images and answers."""
    if image_size < 8:
        raise ValueError(f"--image_size must be >= 8 pixels, got {image_size}")
    rng = random.Random(seed)
    splits: dict[str, list[dict[str, Any]]] = {}
    for split, size in (("train", train_size), ("test", test_size)):
        rows = []
        for index in range(size):
            color = rng.choice(sorted(COLORS))
            row = make_row(data_source=DATA_SOURCE, content=QUESTION, ability="vision", ground_truth=color,
                           extra_info={"split": split, "index": index, "color": color})
            row["images"] = [{"bytes": draw_square(color, image_size, rng)}]
            rows.append(row)
        splits[split] = rows
    return splits


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train_size", type=int, default=512)
    parser.add_argument("--test_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image_size", type=int, default=56, help="canvas side in pixels (56: 4 image tokens "
                        "with Qwen2-VL's 14-pixel patches merged 2x2)")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    args = _parse_args(argv)
    if args.train_size < 0 or args.test_size < 0 or args.train_size + args.test_size == 0:
        raise ValueError(f"--train_size and --test_size must be >= 0 and not both 0, "
                         f"got {args.train_size} and {args.test_size}")
    split_names = [name for name, size in (("train", args.train_size), ("test", args.test_size)) if size > 0]
    check_outputs_free(args.local_dir, split_names, args.overwrite)
    splits = build_rows(args.train_size, args.test_size, args.seed, args.image_size)
    write_splits(args.local_dir, {name: rows for name, rows in splits.items() if rows}, args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
