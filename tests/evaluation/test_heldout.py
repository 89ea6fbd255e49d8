"""`hybridflow eval`'s pieces: held-out problems never repeat excluded questions, answers are verified by the
task, and the intervals are the standard ones."""

import math

import pytest

from hybridflow.data.preprocess.common import write_splits
from hybridflow.data.preprocess.reasoning_gym import PRESETS, build_rows
from hybridflow.evaluation.heldout import (
    compute_pass_at_k,
    excluded_questions,
    heldout_problems,
    pass_at_k_levels,
    paired_gain_interval,
    resolve_eval_model,
    sampled_record,
    sampled_responses,
    score_responses,
    user_message,
)

pytest.importorskip("reasoning_gym")


def _easy():
    task, config, _ = PRESETS["smollm2_easy"]
    return task, dict(config)


def test_heldout_problems_leave_out_every_training_question(tmp_path):
    task, config = _easy()
    splits = build_rows(task, config, train_size=200, test_size=20, seed=0)
    write_splits(tmp_path, splits, overwrite=False)
    seen = excluded_questions([tmp_path / "train.parquet", tmp_path / "test.parquet"])
    assert len(seen) == 220
    # the same generator seed as training: every question it would repeat must be skipped
    problems, _ = heldout_problems(task, config, 50, seed=0, exclude=seen)
    assert len(problems) == 50
    assert not {p.question for p in problems} & seen
    assert len({p.question for p in problems}) == 50


def test_score_responses_uses_the_task_verifier_with_both_extractions():
    task, config = _easy()
    problems, dataset = heldout_problems(task, config, 3, seed=7, exclude=set())
    right = problems[0].answer
    responses = [f"The sum is {right}", f"Answer: {right}", "Answer: 100000 and then 3"]
    marks = score_responses(problems[:1] * 3, responses, dataset)
    assert marks["strict"] == [False, True, False]
    assert marks["flexible"] == [True, True, False]


def test_user_message_styles():
    assert user_message("What is 2 + 2?", "plain") == "What is 2 + 2?"
    assert user_message("What is 2 + 2?", "ours").startswith("What is 2 + 2?\n\nEnd with: Answer:")
    with pytest.raises(ValueError, match="prompt style"):
        user_message("q", "chat")


def test_accuracy_interval_is_wilson():
    from hybridflow.algorithms.validation_metrics import compute_mean_interval

    low, high = compute_mean_interval([1.0] * 20 + [0.0] * 80)
    # Wilson 95% for 20/100: [0.1333, 0.2888]
    assert low == pytest.approx(0.1333, abs=1e-4) and high == pytest.approx(0.2888, abs=1e-4)
    assert compute_mean_interval([0.0] * 10)[0] == 0.0


def test_paired_gain_interval_counts_only_changed_problems():
    base = [False] * 60 + [True] * 40
    other = [True] * 30 + [False] * 30 + [True] * 40  # 30 problems gained, none lost
    mean, low, high = paired_gain_interval(base, other)
    assert mean == pytest.approx(0.30)
    half = 1.959964 * math.sqrt(0.30 * 0.70 * 100 / 99 / 100)
    assert (low, high) == pytest.approx((0.30 - half, 0.30 + half), abs=1e-5)
    assert paired_gain_interval(base, base) == (0.0, 0.0, 0.0)


def test_a_run_directory_resolves_to_its_newest_complete_checkpoint(tmp_path):
    """The pointer file can lag the directories (a kill between a save's rename and its update): the newest
    complete checkpoint is evaluated, as a resume would continue from it; an incomplete one never is."""
    run = tmp_path / "run"
    for step in (3, 6, 9):  # an HF directory stands in for the checkpoint
        (run / f"global_step_{step}").mkdir(parents=True)
    for step in (3, 6):  # 9: a save killed before it completed
        (run / f"global_step_{step}" / "driver_state.json").write_text("{}")
    (run / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert resolve_eval_model(str(run), tmp_path) == str(run / "global_step_6")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "latest_checkpointed_iteration.txt").write_text("2\n")
    with pytest.raises(FileNotFoundError, match="without a complete checkpoint"):
        resolve_eval_model(str(empty), tmp_path)
    with pytest.raises(ValueError, match="neither a catalogue name"):
        resolve_eval_model(str(tmp_path / "missing"), tmp_path)


def test_pass_at_k_is_the_unbiased_estimator():
    assert compute_pass_at_k(8, 0, 8) == 0.0 and compute_pass_at_k(8, 8, 1) == 1.0
    assert compute_pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 is the fraction right
    assert compute_pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert compute_pass_at_k(8, 1, 8) == 1.0  # every sample drawn: the right one is among them
    assert compute_pass_at_k(8, 1, 4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="pass@k"):
        compute_pass_at_k(4, 1, 5)
    assert pass_at_k_levels(8) == [1, 2, 4, 8] and pass_at_k_levels(6) == [1, 2, 4, 6] and pass_at_k_levels(1) == [1]


def test_sampled_record_counts_right_samples_per_problem():
    task, config = _easy()
    problems, dataset = heldout_problems(task, config, 2, seed=7, exclude=set())
    samples = [[f"= {problems[0].answer}", "= 100000", f"so {problems[0].answer}", "no"],
               ["= 100000"] * 4]
    record = sampled_record(problems, samples, dataset)
    assert record["sampled_correct"] == [2, 0] and record["num_samples"] == 4
    assert record["pass_at_k"]["1"] == pytest.approx((2 / 4 + 0) / 2)
    assert record["pass_at_k"]["4"] == pytest.approx((1.0 + 0) / 2)


def test_sampled_responses_give_n_seeded_samples_per_message(tmp_path):
    from hybridflow.models import save_tiny_model

    tiny_llama_dir = save_tiny_model(tmp_path, arch="llama", seed=0)
    messages = ["What is 2 + 2?", "Name a colour.", "Count to three."]
    first = sampled_responses(str(tiny_llama_dir), messages, 6, batch_size=4, num_samples=3, temperature=1.0, seed=3)
    again = sampled_responses(str(tiny_llama_dir), messages, 6, batch_size=4, num_samples=3, temperature=1.0, seed=3)
    assert [len(samples) for samples in first] == [3, 3, 3]
    assert first == again  # seeded
    assert any(len(set(samples)) > 1 for samples in first)  # sampled, not greedy copies
