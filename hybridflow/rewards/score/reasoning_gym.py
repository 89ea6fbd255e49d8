"""reasoning-gym scorer: the text after the last 'Answer:' is checked by the task's own `score_answer`.

Rows may set `extra_info['answer_extraction']='flexible'`: with no 'Answer:' line, the last number counts.

Rows come from `hybridflow.data.preprocess.reasoning_gym`: data_source `reasoning_gym/<task>`,
`reward_model.ground_truth` the oracle answer, and `extra_info` holding `task`, `task_config` (JSON) and
`metadata` (JSON, the entry's metadata) and `question`, which rebuild the entry the verifier expects.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

__all__ = ["compute_score", "extract_answer", "extract_answer_flexible", "preload", "task_from_data_source"]

_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_PREFIX = "reasoning_gym/"


def extract_answer(solution_str: str) -> str | None:
    """The text after the last 'Answer:' (any case), else inside the last <answer></answer>; None if absent.

    Whitespace and markdown emphasis around it are removed, and so is one trailing period of a one-line
    answer ('Answer: 42.' -> '42'), because verifiers compare strings exactly.
    """
    matches = list(_ANSWER.finditer(solution_str))
    if matches:
        text = solution_str[matches[-1].end():]
    else:
        tags = _ANSWER_TAG.findall(solution_str)
        if not tags:
            return None
        text = tags[-1]
    text = text.strip().strip("*").strip()
    if "\n" not in text and text.endswith("."):
        text = text[:-1].rstrip()
    return text or None


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer_flexible(solution_str: str) -> str | None:
    """`extract_answer`, else the last number in the text (commas removed), as verl's gsm8k 'flexible' mode."""
    answer = extract_answer(solution_str)
    if answer is not None:
        return answer
    numbers = _LAST_NUMBER.findall(solution_str)
    return numbers[-1].replace(",", "") if numbers else None


def task_from_data_source(data_source: str) -> str:
    """'reasoning_gym/basic_arithmetic' -> 'basic_arithmetic'."""
    if not data_source.startswith(_PREFIX) or len(data_source) == len(_PREFIX):
        raise ValueError(f"reasoning-gym data_source must look like 'reasoning_gym/<task>', got {data_source!r}")
    return data_source[len(_PREFIX):]


def preload() -> Any:
    """Import reasoning-gym (~1 s). Done in the driver before scoring, so forked scorer processes inherit it
    instead of spending their first call's timeout on the import."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError("scoring reasoning_gym/* rows needs the reasoning-gym package: "
                          "pip install reasoning-gym") from err
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_json: str) -> Any:
    """The task's dataset object (only its `score_answer` is used); cached per worker process."""
    return preload().create_dataset(task, **json.loads(config_json))


def _json_field(extra_info: dict[str, Any], key: str) -> Any:
    if key not in extra_info or extra_info[key] is None:
        raise ValueError(
            f"reasoning-gym rows need extra_info[{key!r}]; write them with hybridflow.data.preprocess.reasoning_gym"
        )
    value = extra_info[key]
    return json.loads(value) if isinstance(value, str) else value


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None,
                  format_score: float = 0.0) -> float:
    """The task verifier's score (0..1) for the extracted answer; 0.0 with no answer; an extracted but
    wrong answer gets at least `format_score`."""
    task = task_from_data_source(data_source)
    extra_info = extra_info or {}
    config = _json_field(extra_info, "task_config")
    metadata = _json_field(extra_info, "metadata")
    mode = extra_info.get("answer_extraction", "strict")
    if mode not in ("strict", "flexible"):
        raise ValueError(f"extra_info['answer_extraction'] must be 'strict' or 'flexible', got {mode!r}")
    answer = extract_answer(solution_str) if mode == "strict" else extract_answer_flexible(solution_str)
    if answer is None:
        return 0.0
    entry = {"question": extra_info.get("question") or "", "answer": str(ground_truth), "metadata": metadata}
    dataset = _dataset(task, json.dumps(config, sort_keys=True))
    return max(float(dataset.score_answer(answer=answer, entry=entry)), format_score)
