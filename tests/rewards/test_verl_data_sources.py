"""Every data source verl's `default_compute_score` knows has a scorer here, and each family scores as verl's
does: MATH-style boxed answers, DAPO's 'Answer:' lines (also for 'math' and any 'aime*'), Geometry3K's
accuracy plus format, and Search-R1's exact match."""

from __future__ import annotations

import numpy as np
import pytest

from hybridflow.rewards.score import default_compute_score, has_scorer, resolve_scorer, search_qa

# verl/utils/reward_score/__init__.py (default_compute_score), as of verl b178a3cd
VERL_DATA_SOURCES = [
    "openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
    "math_dapo", "math", "math_dapo_reasoning", "aime", "aime24", "aime2025_test",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads", "codecontests", "apps", "codeforces", "taco", "hiyouga/geometry3k",
    "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
    "searchR1_musique", "searchR1_bamboogle",
]


@pytest.mark.parametrize("data_source", VERL_DATA_SOURCES)
def test_every_verl_data_source_has_a_scorer(data_source: str) -> None:
    assert has_scorer(data_source)
    assert callable(resolve_scorer(data_source))


def test_unknown_data_sources_are_still_refused_naming_the_registry() -> None:
    assert not has_scorer("maths") and not has_scorer("searchR1")
    with pytest.raises(ValueError, match="no reward scorer for data_source 'maths'"):
        resolve_scorer("maths")


@pytest.mark.parametrize("data_source", ["math", "math_dapo", "aime2024", "aime_validation"])
def test_math_and_aime_score_as_dapo_does(data_source: str) -> None:
    right = default_compute_score(data_source, "so x = 7.\nAnswer: 7", "7")
    wrong = default_compute_score(data_source, "Answer: 8", "7")
    assert right["score"] == 1.0 and right["acc"] and wrong["score"] == -1.0 and not wrong["acc"]


def test_numina_rows_take_the_last_boxed_answer() -> None:
    assert default_compute_score("numina_cn_k12", "first \\boxed{3}, no: \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert default_compute_score("numina_cn_k12", "\\boxed{3}", "0.5") == 0.0


class TestGeometry3K:
    def score(self, response: str, truth: str = "2\\sqrt{3}") -> float:
        return default_compute_score("hiyouga/geometry3k", response, truth)

    def test_right_answer_in_format_scores_one(self) -> None:
        assert self.score("<think>angles add up</think> so \\boxed{2\\sqrt{3}}") == pytest.approx(1.0)

    def test_right_answer_without_the_think_block_scores_the_accuracy_share(self) -> None:
        assert self.score("\\boxed{2 \\sqrt{3}}") == pytest.approx(0.9)

    def test_wrong_answer_in_format_scores_the_format_share(self) -> None:
        assert self.score("<think>hmm</think>\\boxed{4}") == pytest.approx(0.1)
        assert self.score("<think>hmm</think> the answer is 4") == 0.0

    def test_numbers_compare_by_value(self) -> None:
        assert self.score("<think>t</think>\\boxed{0.5}", "\\frac{1}{2}") == pytest.approx(1.0)


class TestSearchQA:
    TRUTH = {"target": np.array(["The Eiffel Tower", "Eiffel tower"], dtype=object)}  # as parquet gives it back

    def score(self, response: str, **kwargs) -> float:
        return default_compute_score("searchR1_nq", response, self.TRUTH, **kwargs)

    def test_last_answer_tag_matches_after_normalisation(self) -> None:
        assert self.score("<answer>Paris</answer> wait <answer>eiffel Tower!</answer>") == 1.0

    def test_wrong_answer_gets_the_format_score_and_no_tag_gets_zero(self) -> None:
        assert self.score("<answer>Louvre</answer>") == 0.0
        assert self.score("<answer>Louvre</answer>", format_score=0.2) == 0.2
        assert self.score("the Eiffel Tower", format_score=0.2) == 0.0

    def test_answer_tag_spam_quarters_a_right_answer(self) -> None:
        spam = "<answer>x</answer>" * 11 + "<answer>Eiffel Tower</answer>"
        assert self.score(spam) == 0.25

    def test_a_string_target_and_a_bad_ground_truth(self) -> None:
        assert search_qa.compute_score("<answer>an apple</answer>", {"target": "Apple"}) == 1.0
        with pytest.raises(ValueError, match="'target'"):
            search_qa.compute_score("<answer>x</answer>", {"target": 3})
