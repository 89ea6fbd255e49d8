"""verl's generation dumps: one JSON line per sample, numpy values made plain, and no file ever overwritten."""

from __future__ import annotations

import json

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.generation_dump import dump_generations, generation_rows


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + int(i)) for i in ids if int(i) > 0)

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(row) for row in rows]


def test_rows_decode_the_batch_and_a_step_written_again_goes_beside_it(tmp_path):
    batch = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([[0, 1, 2], [3, 4, 5]]),
            "responses": torch.tensor([[6, 7, 0], [8, 0, 0]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
            "advantages": torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]),
        },
        non_tensors={"uid": np.array(["a", "b"], dtype=object),
                     "reward_model": np.array([{"ground_truth": "7"}, {"ground_truth": "8"}], dtype=object)},
    )
    rows = generation_rows(batch, CharTokenizer(), [1.0, np.float32(0.0)])
    assert rows == {"input": ["ab", "cde"], "output": ["fg", "h"], "gts": ["7", "8"], "score": [1.0, 0.0],
                    "uid": ["a", "b"], "advantage": [0.5, -1.0]}
    first = dump_generations(tmp_path, 3, {**rows, "acc": np.array([True, False]), "short": [1]})
    again = dump_generations(tmp_path, 3, rows)
    assert (first.name, again.name) == ("3.jsonl", "3.1.jsonl")
    lines = [json.loads(line) for line in first.read_text().splitlines()]
    assert lines[1] == {"input": "cde", "output": "h", "gts": "8", "score": 0.0, "uid": "b", "advantage": -1.0,
                        "acc": False, "step": 3}  # the column of another length is left out
