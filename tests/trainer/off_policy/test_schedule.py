"""`AsyncSchedule`: a seed fixes the interleaving, a script is replayed exactly, impossible events are refused."""

from __future__ import annotations

import pytest

from hybridflow.trainer.off_policy.schedule import AsyncSchedule


def drive(schedule: AsyncSchedule, num_events: int) -> list[str]:
    """Events under a toy rule: training needs a generated batch, at most 2 ahead."""
    ready, events = 0, []
    for _ in range(num_events):
        event = schedule.next_event(can_generate=ready < 2, can_train=ready > 0)
        ready += 1 if event == "generate" else -1
        events.append(event)
    return events


def test_a_seed_fixes_the_interleaving():
    first = drive(AsyncSchedule(seed=3), 40)
    assert first == drive(AsyncSchedule(seed=3), 40)
    assert first != drive(AsyncSchedule(seed=4), 40)
    assert {"generate", "train"} == set(first)


def test_only_possible_events_are_drawn():
    schedule = AsyncSchedule(seed=0)
    assert [schedule.next_event(can_generate=True, can_train=False) for _ in range(5)] == ["generate"] * 5
    assert schedule.next_event(can_generate=False, can_train=True) == "train"
    with pytest.raises(RuntimeError, match="internal error"):
        schedule.next_event(can_generate=False, can_train=False)


def test_a_script_is_replayed_and_a_train_first_finishes_its_batch():
    schedule = AsyncSchedule(events=["generate", "train", "train"])
    assert schedule.next_event(can_generate=True, can_train=False) == "generate"
    assert schedule.next_event(can_generate=True, can_train=True) == "train"
    # the next scripted train waits for its batch: generates until training is possible
    assert schedule.next_event(can_generate=True, can_train=False) == "generate"
    assert schedule.next_event(can_generate=True, can_train=True) == "train"
    assert schedule.history == ["generate", "train", "generate", "train"]
    with pytest.raises(ValueError, match="ran out after 4 events"):
        schedule.next_event(can_generate=True, can_train=True)


def test_an_impossible_scripted_event_is_refused():
    with pytest.raises(ValueError, match=r"event 0 \('generate'\) is not possible"):
        AsyncSchedule(events=["generate"]).next_event(can_generate=False, can_train=True)
    with pytest.raises(ValueError, match="unknown schedule events"):
        AsyncSchedule(events=["sync"])
    with pytest.raises(ValueError, match="exactly one"):
        AsyncSchedule(seed=1, events=["train"])
