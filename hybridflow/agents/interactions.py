"""Interactions: a simulated user that answers each model turn (feedback, a retry request, or the end).

verl's interface: `start_interaction`, `generate_response(instance_id, messages) -> (should_terminate,
response_text, score, metadata)`, `calculate_score`, `finalize_interaction`. Built-in: `answer_feedback`,
which scores the model's last answer with the row's reward scorer and, while it is wrong, tells the model so
and lets it try again (verl's gsm8k interaction, for any data source with a registered scorer).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hybridflow.rewards.score import resolve_scorer
from hybridflow.utils.registry import Registry


class BaseInteraction:
    """Per-trajectory state keyed by instance id; subclasses implement `generate_response`."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        self.instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self.instances[instance_id] = dict(kwargs)
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate, user message, turn score, metadata) after the model's latest turn."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_response()")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.instances.get(instance_id, {}).get("score", 0.0))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.instances.pop(instance_id, None)


INTERACTIONS: Registry[type[BaseInteraction]] = Registry("interaction")


@INTERACTIONS.register("answer_feedback")
class AnswerFeedbackInteraction(BaseInteraction):
    """Scores the last assistant message with the reward scorer of `data_source`; wrong -> retry message.

    start_interaction kwargs: `data_source`, `ground_truth`, optional `extra_info`.
    config: `incorrect_message`, `correct_message`.
    """

    async def generate_response(
        self, instance_id: str, messages: list[dict], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instances[instance_id]
        answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        scorer = resolve_scorer(state["data_source"])
        result = scorer(state["data_source"], answer, state["ground_truth"], state.get("extra_info"))
        score = float(result["score"] if isinstance(result, dict) else result)
        state["score"] = score
        if score >= 1.0:
            return True, self.config.get("correct_message", "Your answer is correct."), score, {}
        message = self.config.get(
            "incorrect_message", "Your answer is incorrect. Check your work and give the final answer again."
        )
        return False, message, score, {}


def load_interactions(path: str | os.PathLike[str]) -> dict[str, BaseInteraction]:
    """Read `interaction: [{name, type | class_name, config}]` from a YAML file; name -> instance."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    entries = data.get("interaction")
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise ValueError(f"{path}: expected a list under 'interaction', got {type(entries).__name__}")
    interactions: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: interaction[{index}]"
        if not isinstance(entry, Mapping) or "name" not in entry:
            raise ValueError(f"{where} needs a 'name' (and 'type' or 'class_name')")
        if "class_name" in entry:
            module_name, _, class_name = str(entry["class_name"]).rpartition(".")
            import importlib

            cls = getattr(importlib.import_module(module_name), class_name)
        else:
            cls = INTERACTIONS.get(entry.get("type", entry["name"]))
        if entry["name"] in interactions:
            raise ValueError(f"{where}: name {entry['name']!r} is used twice")
        interactions[entry["name"]] = cls(entry.get("config"))
    return interactions
