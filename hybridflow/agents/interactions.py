"""Interactions: a simulated user that answers each model turn (feedback, a retry request, or the end).

verl's interface: `start_interaction`, `generate_response(instance_id, messages) -> (should_terminate,
response_text, score, metadata)`, `calculate_score`, `finalize_interaction`. Built-in: `answer_feedback`,
which scores the model's last answer with the row's reward scorer and, while it is wrong, tells the model so
and lets it try again (verl's gsm8k interaction, for any data source with a registered scorer); and `gsm8k`,
verl's `verl.interactions.gsm8k_interaction.Gsm8kInteraction` itself (strict GSM8K extraction, its messages), which
a verl interaction file naming that class builds.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hybridflow.rewards.score import resolve_scorer
from hybridflow.rewards.score.gsm8k import compute_score as compute_gsm8k_score
from hybridflow.utils.config import check_mapping_keys
from hybridflow.utils.file_module import import_dotted
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
    config: `incorrect_message`, `correct_message`, `score_timeout_s`.
    """

    CONFIG_KEYS = ("correct_message", "incorrect_message", "name", "score_timeout_s")

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self._pool: Any = None  # a `ScorerPool`, started at the first answer
        self._pool_lock = threading.Lock()

    async def generate_response(
        self, instance_id: str, messages: list[dict], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instances[instance_id]
        answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        score, problem = await self._score(state, answer)
        state["score"] = score
        if score >= 1.0:
            return True, self.config.get("correct_message", "Your answer is correct."), score, {}
        message = self.config.get(
            "incorrect_message", "Your answer is incorrect. Check your work and give the final answer again."
        )
        return False, message, score, {"score_error": problem} if problem else {}

    async def _score(self, state: dict[str, Any], answer: str) -> tuple[float, str | None]:
        """The answer's score, off the event loop (a code row runs its sandbox; the other rows' turns go on), in a
        scorer process of its own (`rewards.pool.ScorerPool`) within `config.score_timeout_s` (default 30): a scorer
        that raises, hangs (even in C code: its process is killed) or returns no finite number scores 0, with what
        went wrong (the tool agent counts it as `interaction_score_errors`)."""
        data_source = state["data_source"]
        scorer = resolve_scorer(data_source)
        kwargs = {"data_source": data_source, "solution_str": answer, "ground_truth": state["ground_truth"],
                  "extra_info": state.get("extra_info")}
        timeout_s = float(self.config.get("score_timeout_s", 30.0))
        outcome = await asyncio.to_thread(self._run_scorer, scorer, kwargs, timeout_s)
        if outcome.status == "timeout":
            return 0.0, f"the {data_source!r} scorer took over {timeout_s:g} s"
        if outcome.status == "error":
            last_line = outcome.message.strip().splitlines()[-1] if outcome.message.strip() else "an error"
            return 0.0, f"the {data_source!r} scorer raised {last_line[:200]}"
        try:
            score = float(outcome.value["score"] if isinstance(outcome.value, dict) else outcome.value)
        except (TypeError, ValueError, KeyError) as err:
            return 0.0, f"the {data_source!r} scorer returned {outcome.value!r:.100} ({type(err).__name__})"
        if not math.isfinite(score):
            return 0.0, f"the {data_source!r} scorer returned {score}"
        return score, None

    def _run_scorer(self, scorer: Any, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """One scorer call in the interaction's scorer processes (one call at a time: the pool is not shared
        between threads), a `ScoreOutcome`."""
        from hybridflow.rewards.pool import ScoreOutcome, ScorerPool, ScoringConfig  # only once a turn is scored

        with self._pool_lock:
            if self._pool is None:
                self._pool = ScorerPool(ScoringConfig(timeout_s=timeout_s, num_workers=1),
                                        counted_in="interaction/score_errors")
            try:
                return self._pool.run([(scorer, kwargs)])[0]
            except TypeError as err:  # a scorer the processes cannot be sent (a lambda, a local function)
                return ScoreOutcome("error", message=f"TypeError: {err}")


@INTERACTIONS.register("gsm8k")
class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K interaction: the last assistant message is scored against `ground_truth` (the row's
    `interaction_kwargs`) with strict GSM8K extraction (`#### <answer>`); right ends the trajectory, wrong asks for
    another try, in verl's words."""

    CONFIG_KEYS = ("name",)  # verl's interaction files repeat the entry's name in its config

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        if kwargs.get("ground_truth") is None:
            raise ValueError("the gsm8k interaction needs the problem's answer: give each row "
                             "extra_info.interaction_kwargs.ground_truth (verl's GSM8K preprocessing does)")
        return await super().start_interaction(instance_id, **kwargs)

    async def generate_response(
        self, instance_id: str, messages: list[dict], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instances[instance_id]
        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        state["score"] = compute_gsm8k_score(answer, str(state["ground_truth"]), method="strict")
        if state["score"] == 1.0:
            return True, "Your response is correct!", state["score"], {}
        retry = "Your response is incorrect! You need to reflect on your answer and try again."
        return False, retry, state["score"], {}


VERL_INTERACTION_CLASSES = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": "gsm8k"}
"""verl's interaction classes that a registered interaction here reproduces: a verl interaction file naming one
builds it."""


ENTRY_KEYS = ("name", "type", "class_name", "config")
"""The keys of one `interaction:` entry."""


def load_interactions(path: str | os.PathLike[str]) -> dict[str, BaseInteraction]:
    """Read `interaction: [{name, type | class_name, config}]` from a YAML file; name -> instance. Every mistake
    is a ValueError naming the file and the entry: broken YAML, an unknown entry key or type, and, for the
    built-in interactions (`CONFIG_KEYS`), a config key they do not read (a misspelt one was ignored)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from err
    entries = data.get("interaction") if isinstance(data, Mapping) else None
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise ValueError(f"{path}: expected a list under 'interaction', got {type(entries).__name__}")
    interactions: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: interaction[{index}]"
        if not isinstance(entry, Mapping) or "name" not in entry:
            raise ValueError(f"{where} needs a 'name' (and 'type' or 'class_name')")
        check_mapping_keys(entry, where, set(ENTRY_KEYS))
        cls = _interaction_class(entry, where)
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
        known = getattr(cls, "CONFIG_KEYS", None)
        if known is not None and set(config) - set(known):
            raise ValueError(f"{where}: config keys {sorted(set(config) - set(known))} are not read by "
                             f"{cls.__name__}; it reads {sorted(known)}")
        if entry["name"] in interactions:
            raise ValueError(f"{where}: name {entry['name']!r} is used twice")
        interactions[entry["name"]] = cls(config)
    return interactions


def _interaction_class(entry: Mapping[str, Any], where: str) -> type[BaseInteraction]:
    if entry.get("class_name") in VERL_INTERACTION_CLASSES:
        return INTERACTIONS.get(VERL_INTERACTION_CLASSES[entry["class_name"]])
    if "class_name" in entry:
        return import_dotted(
            str(entry["class_name"]), where, "package.module.InteractionClass",
            verl_hint=f"of verl's interaction classes hybridflow builds only {sorted(VERL_INTERACTION_CLASSES)}: "
                      f"name a registered one with `type:` ({INTERACTIONS.names()})",
        )
    name = str(entry.get("type", entry["name"]))
    if name not in INTERACTIONS:
        raise ValueError(f"{where}: interaction type {name!r} is unknown; known: {INTERACTIONS.names()} (or give a "
                         "class_name)")
    return INTERACTIONS.get(name)

