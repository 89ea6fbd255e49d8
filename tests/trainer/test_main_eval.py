"""`hybridflow score` (verl's main_eval): verl's command line scores a generated file per data source; malformed
rows, unknown data sources and existing outputs are refused before any scorer starts; a raising or hung custom
function costs its responses and is counted; code responses run in the sandbox."""

from __future__ import annotations

import ast

import pandas as pd
import pytest

from hybridflow.cli import main as cli_main
from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.evaluation_checks import validate_evaluation_config
from hybridflow.trainer.config.loader import EVALUATION_TREE
from hybridflow.trainer.main_eval import main as eval_main
from tests.helpers import nothing_started

GSM8K = "openai/gsm8k"


def write_generated(path, rows) -> str:
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def gsm8k_row(truth: str, responses: list[str]) -> dict:
    return {"data_source": GSM8K, "prompt": [{"role": "user", "content": f"what gives {truth}?"}],
            "reward_model": {"ground_truth": truth, "style": "rule"}, "responses": responses}


@pytest.fixture
def generated(tmp_path):
    """Three rows of two data sources, as `hybridflow generate` writes them (a `responses` list per row)."""
    return write_generated(tmp_path / "gen.parquet", [
        gsm8k_row("4", ["#### 4", "#### 5", "#### 4", "no answer"]),
        gsm8k_row("7", ["#### 7", "#### 7", "#### 7", "#### 7"]),
        {"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": "half?"}],
         "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"},
         "responses": ["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "\\boxed{3}", "\\boxed{3}"]},
    ])


def last_dict(out: str) -> dict:
    """verl's metric dict: the last line main_eval prints."""
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_verl_s_line_scores_per_data_source_and_writes_the_scores(generated, tmp_path, capsys):
    output = tmp_path / "out" / "scored.parquet"
    args = [f"data.path={generated}", "data.response_key=responses", "data.data_source_key=data_source",
            "data.reward_model_key=reward_model", "ray_kwargs.ray_init.num_cpus=2", f"data.output_path={output}"]
    assert cli_main(["score", *args]) == 0
    out = capsys.readouterr().out
    metrics = last_dict(out)
    assert metrics == pytest.approx({"test_score/openai/gsm8k": (2 / 4 + 4 / 4) / 2, "test_score/lighteval/MATH": 0.25})
    assert "openai/gsm8k" in out and "pass@n" in out  # the per-source table
    frame = pd.read_parquet(output)
    assert [list(row) for row in frame["scores"]] == [[1, 0, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert list(frame.columns) == ["data_source", "prompt", "reward_model", "responses", "scores"]


def test_report_counts_pass_at_n_errors_and_timeouts_per_source(tmp_path):
    from hybridflow.trainer.offline_evaluation import run_evaluation

    scorer = tmp_path / "scorer.py"
    scorer.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'hang':\n        time.sleep(60)\n"
        "    if solution_str == 'raise':\n        raise RuntimeError('scorer bug')\n"
        "    return {'score': float(solution_str == ground_truth), 'acc': solution_str == ground_truth}\n")
    path = write_generated(tmp_path / "gen.parquet", [
        {"data_source": "a", "reward_model": {"ground_truth": "x"}, "responses": ["x", "hang", "y"]},
        {"data_source": "a", "reward_model": {"ground_truth": "x"}, "responses": ["y", "y", "raise"]},
        {"data_source": "b", "reward_model": {"ground_truth": "z"}, "responses": ["z"]},
    ])
    cfg = load_config([f"data.path={path}", f"custom_reward_function.path={scorer}",
                       "reward_model.scoring.timeout_s=1", "reward_model.scoring.num_workers=2"], EVALUATION_TREE)
    metrics = run_evaluation(cfg, validate_evaluation_config(cfg))
    assert metrics["test_score/a"] == pytest.approx((1 / 3 + 0) / 2)
    assert metrics["a/pass@n"] == 0.5 and metrics["a/responses"] == 6 and metrics["a/rows"] == 2
    assert (metrics["a/errors"], metrics["a/timeouts"]) == (1, 1)
    assert (metrics["test_score/b"], metrics["b/errors"], metrics["b/timeouts"]) == (1.0, 0, 0)


def test_code_responses_run_in_the_sandbox_and_a_program_that_exits_early_scores_nothing(tmp_path, capsys):
    cases = '{"inputs": ["2 3\\n", "10 -4\\n"], "outputs": ["5\\n", "6\\n"]}'
    honest = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    forged = "```python\nimport os\nos._exit(0)\n```"
    path = write_generated(tmp_path / "gen.parquet", [
        {"data_source": "codecontests", "reward_model": {"ground_truth": cases}, "responses": [honest, forged]}])
    assert eval_main([f"data.path={path}", "reward_model.scoring.num_workers=1"]) == 0
    assert last_dict(capsys.readouterr().out) == {"test_score/codecontests": 0.5}


@pytest.mark.parametrize("rows, extra, message", [
    ([gsm8k_row("4", [])], (), r"row 0: column 'responses' must hold the row's responses"),
    ([{**gsm8k_row("4", ["#### 4"]), "reward_model": {"style": "rule"}}], (), "must hold {'ground_truth'"),
    ([{**gsm8k_row("4", ["#### 4"]), "data_source": "my/unknown"}], (), r"no reward scorer for data_source \['my/unknown'\]"),
    ([gsm8k_row("4", ["#### 4"])], ("data.response_key=answers",), "data.response_key='answers' is not a column"),
    ([gsm8k_row("4", ["#### 4"])], ("ray_kwargs.ray_init.address=ray://head:10001",), "no Ray cluster is joined"),
    ([gsm8k_row("4", ["#### 4"])], ("custom_reward_function.path=/nowhere/scorer.py",),
     "custom_reward_function: custom_reward_function.path not found"),
    ([gsm8k_row("4", ["#### 4"])], ("reward_model.sandbox_fusion.url=http://sandbox:8080/run_code",
                                    "reward_model.scoring.num_workers=2", "ray_kwargs.ray_init.num_cpus=80"),
     "max_concurrent=64 is below ray_kwargs.ray_init.num_cpus=80"),
])
def test_bad_rows_and_settings_are_refused_before_scoring(tmp_path, rows, extra, message):
    path = write_generated(tmp_path / "gen.parquet", rows)
    with nothing_started(), pytest.raises(ValueError, match=message):
        validate_evaluation_config(load_config([f"data.path={path}", *extra], EVALUATION_TREE))


@pytest.mark.parametrize("extra, keys", [
    (("reward_model.format_score=0.1",), r"reward_model.format_score=0.1"),
    (("reward_model.scoring.sandbox.memory_mb=64",), r"reward_model.scoring.sandbox.memory_mb=64"),
    (("reward_model.sandbox_fusion.url=http://sandbox:8080/run_code",), r"reward_model.sandbox_fusion.url="),
])
def test_settings_of_the_built_in_scorers_are_refused_with_a_custom_function(tmp_path, extra, keys):
    """A custom function replaces the built-in scorers and is not given their settings (partial credit, the local
    sandbox's limits, the remote sandbox): each was accepted and had no effect."""
    path = write_generated(tmp_path / "gen.parquet", [gsm8k_row("4", ["#### 4"])])
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    base = [f"data.path={path}", f"custom_reward_function.path={scorer}"]
    with nothing_started(), pytest.raises(ValueError, match=rf"{keys}.* configure the built-in scorers, but "
                                                            r"custom_reward_function.path=.* replaces them"):
        validate_evaluation_config(load_config([*base, *extra], EVALUATION_TREE))
    validate_evaluation_config(load_config(base, EVALUATION_TREE))


def test_an_existing_output_is_never_written_over(generated, tmp_path, capsys):
    output = tmp_path / "scored.parquet"
    output.write_text("keep me")
    assert eval_main([f"data.path={generated}", f"data.output_path={output}"]) == 2
    assert "exists; scoring never writes over a file" in capsys.readouterr().err
    assert output.read_text() == "keep me"


def test_a_column_of_strings_is_one_response_per_row(tmp_path, capsys):
    path = write_generated(tmp_path / "gen.parquet", [
        {"data_source": GSM8K, "reward_model": {"ground_truth": "4"}, "answer": "#### 4"},
        {"data_source": GSM8K, "reward_model": {"ground_truth": "4"}, "answer": "#### 3"}])
    assert eval_main([f"data.path={path}", "data.response_key=answer", "reward_model.scoring.num_workers=1"]) == 0
    assert last_dict(capsys.readouterr().out) == {"test_score/openai/gsm8k": 0.5}


def test_dry_run_prints_the_arithmetic_without_scoring(generated, capsys):
    with nothing_started():
        assert eval_main(["--dry-run", f"data.path={generated}", "ray_kwargs.ray_init.num_cpus=3"]) == 0
    out = capsys.readouterr().out
    assert "responses            12" in out and "scorer processes     3" in out and "data sources         2" in out
