"""StatefulSampler: seeded order, and resuming mid-epoch gives exactly the uninterrupted order."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from hybridflow.data import StatefulSampler, build_sampler

DATASET = list(range(10))


def loader(sampler: StatefulSampler) -> DataLoader:
    return DataLoader(DATASET, batch_size=3, sampler=sampler, collate_fn=list, num_workers=0)


def take(sampler: StatefulSampler, num_batches: int) -> list[list[int]]:
    """The next `num_batches` batches, restarting the loader at epoch ends as a trainer does."""
    batches: list[list[int]] = []
    while len(batches) < num_batches:
        for batch in loader(sampler):
            batches.append(batch)
            if len(batches) == num_batches:
                break
    return batches


@pytest.mark.parametrize("steps_before_save", [2, 4, 5])  # mid-epoch, right at the epoch end, next epoch
def test_resume_equals_uninterrupted_run(steps_before_save: int) -> None:
    uninterrupted = take(build_sampler(DATASET, shuffle=True, seed=7), 9)

    first = build_sampler(DATASET, shuffle=True, seed=7)
    before = take(first, steps_before_save)
    state = first.state_dict()
    resumed = build_sampler(DATASET, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    after = take(resumed, 9 - steps_before_save)
    assert before + after == uninterrupted


def test_order_is_a_seeded_permutation_per_epoch() -> None:
    sampler = build_sampler(DATASET, shuffle=True, seed=3)
    epoch0, epoch1 = list(sampler), list(sampler)
    assert sorted(epoch0) == sorted(epoch1) == DATASET
    assert epoch0 == torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    assert epoch1 == torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    assert list(build_sampler(DATASET, shuffle=False, seed=3)) == DATASET


def test_state_from_another_setup_is_refused() -> None:
    state = build_sampler(DATASET, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        build_sampler(DATASET, shuffle=True, seed=2).load_state_dict(state)


def test_an_unseeded_sampler_draws_its_seed_and_a_resume_continues_its_order(caplog) -> None:
    """data.seed=null (verl's default): each run draws a seed (logged); a resume takes the checkpoint's."""
    with caplog.at_level("INFO", logger="hybridflow.data.sampler"):
        first = build_sampler(list(range(1000)), shuffle=True, seed=None)
    other = build_sampler(list(range(1000)), shuffle=True, seed=None)
    assert first.seed != other.seed and list(first) != list(other)  # 2**-31 odds of a tie
    assert f"seed {first.seed} (saved" in caplog.text
    drawn = build_sampler(DATASET, shuffle=True, seed=None)  # the run that saves
    uninterrupted = take(build_sampler(DATASET, shuffle=True, seed=drawn.seed), 7)
    before = take(drawn, 4)
    resumed = build_sampler(DATASET, shuffle=True, seed=None)
    resumed.load_state_dict(drawn.state_dict())
    assert resumed.seed == drawn.seed and before + take(resumed, 3) == uninterrupted
    with pytest.raises(ValueError, match="seed="):  # a seed set on the command line still must match
        build_sampler(DATASET, shuffle=True, seed=drawn.seed + 1).load_state_dict(drawn.state_dict())


def test_data_seed_null_loads_as_verl_writes_it() -> None:
    from hybridflow.trainer.config import load_config

    assert load_config(["data.seed=null"]).data.seed is None
    assert load_config([]).data.seed == 1


def test_state_error_names_what_changed_without_touching_the_sampler() -> None:
    """The pre-Ray resume check asks `state_error` of the driver's sampler; it must not move it."""
    saved = build_sampler(DATASET, shuffle=True, seed=1)
    take(saved, 3)
    state = saved.state_dict()
    fewer = build_sampler(DATASET[:7], shuffle=True, seed=1)
    error = fewer.state_error(state)
    assert "num_samples=10 (the training rows after filtering)" in error and "num_samples=7" in error
    assert fewer.state_dict()["position"] == 0
    assert build_sampler(DATASET, shuffle=True, seed=1).state_error(state) is None
    assert "data.sampler.class_path" in build_sampler(DATASET, shuffle=True, seed=1).state_error(
        {"epoch": 0, "position": 1, "finished": False, "sampler": None})
    with pytest.raises(ValueError, match="num_samples=10"):
        fewer.load_state_dict(state)
