"""Rule scorers on right, wrong and badly formatted answers, and dispatch on data_source."""

from __future__ import annotations

import json

import pytest

from hybridflow.rewards import SCORERS, default_compute_score, resolve_scorer
from hybridflow.rewards.score import countdown, gsm8k, math, math_dapo, reasoning_gym


class TestGsm8k:
    def test_strict(self) -> None:
        assert gsm8k.compute_score("6 * 7 = 42\n#### 42", "42") == 1.0
        assert gsm8k.compute_score("#### 1,234", "1234") == 1.0
        assert gsm8k.compute_score("#### 42.0", "42") == 1.0
        assert gsm8k.compute_score("#### $42.", "42") == 1.0
        assert gsm8k.compute_score("#### 41", "42") == 0.0
        assert gsm8k.compute_score("#### 41", "42", format_score=0.1) == 0.1
        assert gsm8k.compute_score("The answer is 42", "42") == 0.0
        assert gsm8k.compute_score("The answer is 42", "42", format_score=0.1) == 0.0

    def test_flexible_takes_the_last_number(self) -> None:
        assert gsm8k.compute_score("3 apples, so the answer is 42.", "42", method="flexible") == 1.0
        assert gsm8k.compute_score("42 first, then 43", "42", method="flexible") == 0.0
        assert gsm8k.compute_score("no digits", "42", method="flexible") == 0.0

    def test_only_the_tail_is_searched(self) -> None:
        assert gsm8k.compute_score("#### 42" + " blah" * 100, "42") == 0.0

    def test_dispatch(self) -> None:
        assert default_compute_score("openai/gsm8k", "#### 42", "42") == 1.0
        assert default_compute_score("openai/gsm8k", "#### 41", "42", format_score=0.2) == 0.2


class TestMath:
    @pytest.mark.parametrize("truth", ["0.5", "\\frac12", "\\frac{1}{2}", "\\dfrac{1}{2}", "1/2", ".5", "2/4"])
    def test_half_in_many_spellings(self, truth: str) -> None:
        assert math.compute_score("So the answer is $\\boxed{\\frac{1}{2}}$.", truth) == 1.0

    @pytest.mark.parametrize(("boxed", "truth"), [
        ("\\boxed{\\sqrt{2}}", "\\sqrt2"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{90^\\circ}", "90"),
        ("\\boxed{\\left(1, 2\\right)}", "(1,2)"),
        ("\\boxed{10 \\text{ cm}}", "10"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed 7", "7"),
        ("\\fbox{7}", "7"),
    ])
    def test_normalization(self, boxed: str, truth: str) -> None:
        assert math.compute_score(f"Thus {boxed}", truth) == 1.0

    def test_wrong_and_unformatted(self) -> None:
        assert math.compute_score("\\boxed{3}", "4") == 0.0
        assert math.compute_score("\\boxed{3}", "4", format_score=0.1) == 0.1
        assert math.compute_score("The answer is 1/2", "1/2", format_score=0.1) == 0.0
        assert math.compute_score("\\boxed{\\frac{1}{2}", "1/2") == 0.0  # unbalanced braces: no answer

    def test_last_box_counts_and_boxed_truth_is_unboxed(self) -> None:
        assert math.compute_score("\\boxed{1} no wait \\boxed{2}", "2") == 1.0
        assert math.compute_score("\\boxed{1} no wait \\boxed{2}", "1") == 0.0
        assert math.compute_score("\\boxed{2}", "the solution gives \\boxed{2}") == 1.0

    def test_helpers(self) -> None:
        assert math.last_boxed_only_string("a \\boxed{\\frac{a}{b}} c") == "\\boxed{\\frac{a}{b}}"
        assert math.remove_boxed("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
        assert math.strip_string("\\dfrac{3}{4}") == "\\frac{3}{4}"

    @pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "numina_olympiads"])
    def test_dispatch(self, source: str) -> None:
        assert default_compute_score(source, "\\boxed{\\frac{1}{2}}", "0.5") == 1.0


class TestCountdown:
    TRUTH = {"target": 16, "numbers": [2, 3, 5]}

    @pytest.mark.parametrize("response", [
        "(3+5)*2", "<think>try</think><answer>(3 + 5) * 2</answer>", "Answer: (3+5)*2 = 16", "2*(5+3)",
    ])
    def test_right(self, response: str) -> None:
        assert countdown.compute_score(response, self.TRUTH) == 1.0

    @pytest.mark.parametrize("response", ["(3+5)*2*2", "(3+3)*2+2+2", "3+5+2", "16", "(3+5)*2+0"])
    def test_wrong_numbers_or_value_get_the_format_score(self, response: str) -> None:
        assert countdown.compute_score(response, self.TRUTH) == 0.0
        assert countdown.compute_score(response, self.TRUTH, format_score=0.1) == 0.1

    @pytest.mark.parametrize("response", [
        "__import__('os').system('echo hi')", "2**3*2", "(3+5)*2.0", "-(3+5)*-2", "3/(5-5)*2", "", "(3+5",
    ])
    def test_not_an_equation_scores_zero(self, response: str) -> None:
        assert countdown.compute_score(response, self.TRUTH, format_score=0.1) == 0.0

    def test_ground_truth_as_json_and_dispatch(self) -> None:
        assert countdown.compute_score("(3+5)*2", json.dumps(self.TRUTH)) == 1.0
        assert default_compute_score("countdown", "(3+5)*2", self.TRUTH) == 1.0
        assert countdown.evaluate_equation("7/2") is not None and countdown.evaluate_equation("7/2")[0] == 3.5


class TestReasoningGym:
    @pytest.mark.parametrize(("response", "answer"), [
        ("5 + 3 is 8.\nAnswer: 8", "8"),
        ("Answer: 8.", "8"),
        ("**Answer:** 8", "8"),
        ("answer: first\nthen ANSWER: 9", "9"),
        ("<answer>12</answer>", "12"),
        ("Answer: a\nb", "a\nb"),
        ("I think 8", None),
        ("Answer:   ", None),
    ])
    def test_extract_answer(self, response: str, answer: str | None) -> None:
        assert reasoning_gym.extract_answer(response) == answer

    def test_needs_extra_info_from_the_preprocess_script(self) -> None:
        with pytest.raises(ValueError, match="extra_info\\['task_config'\\]"):
            default_compute_score("reasoning_gym/chain_sum", "Answer: 1", "1", {})

    def test_scores_with_the_task_verifier(self) -> None:
        rg = pytest.importorskip("reasoning_gym")
        dataset = rg.create_dataset("chain_sum", size=1, seed=3)
        entry = dataset[0]
        extra_info = {"task": "chain_sum", "task_config": json.dumps({"seed": 3, "size": 1}),
                      "metadata": json.dumps(entry["metadata"]), "question": entry["question"]}
        source = "reasoning_gym/chain_sum"
        assert default_compute_score(source, f"Answer: {entry['answer']}", entry["answer"], extra_info) == 1.0
        wrong = str(int(entry["answer"]) + 1)
        assert default_compute_score(source, f"Answer: {wrong}", entry["answer"], extra_info) == 0.0
        assert default_compute_score(source, f"Answer: {wrong}", entry["answer"], extra_info, format_score=0.1) == 0.1
        assert default_compute_score(source, "no idea", entry["answer"], extra_info, format_score=0.1) == 0.0


class TestMathDapo:
    """verl's math_dapo rule: the last "Answer:" line, Minerva normalisation, +1 / -1."""

    @pytest.mark.parametrize(("response", "truth"), [
        ("so x = 3.\nAnswer: 3", "3"),
        ("Answer: $\\frac{1}{2}$", "\\frac12"),  # shorthand and $...$ normalised alike
        ("answer : 1,000 dollars", "1000"),  # case, thousands separator and units
        ("Answer: 5 then more thinking\nAnswer: x = \\boxed{7}", "7"),  # the last line; after '='; unboxed
        ("Answer: 90^\\circ", "90"),
    ])
    def test_right_answers(self, response, truth) -> None:
        assert math_dapo.compute_score(response, truth) == {"score": 1.0, "acc": True,
                                                             "pred": math_dapo.normalize_final_answer(truth)}

    @pytest.mark.parametrize(("response", "truth"), [
        ("Answer: 4", "3"),
        ("\\boxed{3}", "3"),  # no Answer line: DAPO's rule reads only that line
        ("Answer: 3" + " padding" * 60, "3"),  # the line is outside the searched tail
    ])
    def test_other_answers_score_minus_one(self, response, truth) -> None:
        result = math_dapo.compute_score(response, truth)
        assert result["score"] == -1.0 and result["acc"] is False

    def test_dapo_and_aime_data_sources_dispatch_to_it(self) -> None:
        for source in ("math_dapo", "aime2024", "aime25"):
            assert default_compute_score(source, "Answer: 12", "12")["score"] == 1.0
        assert default_compute_score("math_dapo", "Answer: 11", "12")["score"] == -1.0


def test_unknown_data_source_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no reward scorer for data_source 'nope/x'; known: \[.*'openai/gsm8k'"):
        resolve_scorer("nope/x")
    assert resolve_scorer("reasoning_gym/anything") is SCORERS.get("reasoning_gym")
    with pytest.raises(ValueError, match="already registered"):
        SCORERS.register("countdown", lambda **kw: 0.0)


def test_reasoning_gym_flexible_extraction_falls_back_to_the_last_number():
    from hybridflow.rewards.score.reasoning_gym import extract_answer_flexible

    assert extract_answer_flexible("So, 88 - 58 = 30.") == "30"
    assert extract_answer_flexible("It is 1,234 in total") == "1234"
    assert extract_answer_flexible("7 apples. Answer: 12") == "12"  # an Answer: line wins
    assert extract_answer_flexible("no digits here") is None


HOSTILE_RESPONSES = [
    "So the answer is \\boxed ", "So the answer is \\boxed $", "\\fbox  \n", "\\boxed{", "\\boxed{" * 3000,
    "\\boxed{" + "9" * 5000 + "}", "\\boxed{\\frac{" + "9" * 5000 + "}{3}}", "\\boxed{\\frac{1}{0}}",
    "#### " + "9" * 5000, "Answer: " + "9" * 5000, "<answer>" + "9" * 5000 + "</answer>", "9" * 100_000,
]
CODE_SCORERS = {"openai_humaneval", "code", "codecontests", "apps", "codeforces", "taco"}  # sandboxed: test_code_*


@pytest.mark.parametrize("data_source", [name for name in SCORERS.names() if name not in CODE_SCORERS])
def test_hostile_responses_score_as_wrong_answers_and_never_raise(data_source: str) -> None:
    """Model output is untrusted: a bare `\\boxed `, braces that never close, or numbers past Python's digit
    limit score as a wrong answer. A scorer that raises is counted as an error by the reward pool, and a batch
    of them stops the run (`reward_model.max_error_fraction`): before, `\\boxed ` at the end of a MATH answer
    and a boxed number of 5,000 digits raised ValueError."""
    truth = {"countdown": {"target": 24, "numbers": [1, 2, 3, 4]}, "color_square": "red"}.get(data_source, "5")
    source, extra = data_source, {}
    if data_source == "reasoning_gym":
        entry = pytest.importorskip("reasoning_gym").create_dataset("chain_sum", size=1, seed=3)[0]
        source, truth = "reasoning_gym/chain_sum", str(int(entry["answer"]) + 1)  # never the responses' numbers
        extra = {"task": "chain_sum", "task_config": json.dumps({"seed": 3, "size": 1}), "question": entry["question"],
                 "metadata": json.dumps(entry["metadata"]), "answer_extraction": "flexible"}
    for response in HOSTILE_RESPONSES:
        result = default_compute_score(source, response, truth, extra)
        score = result["score"] if isinstance(result, dict) else result
        assert score <= 0.0, (response[:40], result)
