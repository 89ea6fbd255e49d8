"""Agent loops against a scripted generation server: token bookkeeping, masks, tools, interactions, limits."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from hybridflow.agents.base import AgentLoopOutput
from hybridflow.agents.chat import ChatEncoder
from hybridflow.agents.interactions import AnswerFeedbackInteraction, load_interactions
from hybridflow.agents.manager import AgentLoopManager, agent_columns, agent_metrics, build_output
from hybridflow.agents.server_manager import AsyncLLMServerManager
from hybridflow.agents.single_turn import SingleTurnAgentLoop
from hybridflow.agents.tool_agent import ToolAgentLoop, truncate_text
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.config import RolloutConfig, SamplingConfig
from hybridflow.engines.rollout.server import TokenOutput
from hybridflow.protocol import DataProto
from hybridflow.single_controller import CONTROL_GROUP
from hybridflow.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from hybridflow.tools.calculator import CalculatorTool
from tests.agents.scripted_server import PARAMS, QUESTION, ScriptedServer, call, context


def segments(out: AgentLoopOutput) -> list[tuple[int, int]]:
    """(mask value, run length) runs of the response mask."""
    runs: list[tuple[int, int]] = []
    for value in out.response_mask:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def test_incremental_encoding_equals_the_full_template(chat_tokenizer):
    """prompt + generated ids + follow-up ids == the template's rendering of the whole conversation."""
    encoder = ChatEncoder(chat_tokenizer)
    prompt = encoder.encode_prompt(QUESTION)
    answer = chat_tokenizer("Let me compute.", add_special_tokens=False)["input_ids"] + [chat_tokenizer.eos_token_id]
    followup = encoder.encode_followup([{"role": "user", "content": "Are you sure?"}], chat_tokenizer.decode(answer))
    conversation = [*QUESTION, {"role": "assistant", "content": "Let me compute."}, {"role": "user", "content": "Are you sure?"}]
    expected = chat_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert chat_tokenizer.decode(prompt + answer + followup) == expected
    # A turn cut without eos gets the template's whole end-of-turn text in front of the next message.
    cut = encoder.encode_followup([{"role": "tool", "content": "5"}], "partial")
    assert chat_tokenizer.decode(cut).startswith("<|im_end|>\n<|im_start|>tool\n5")


def test_tool_agent_trains_only_model_tokens_and_feeds_tool_output_back(chat_tokenizer):
    server = ScriptedServer(chat_tokenizer, [call("calculator", expression="2 + 3"), "The answer is 5."])
    ctx = context(chat_tokenizer, server, tools={"calculator": CalculatorTool()})
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r1"))
    first, second = server.outputs
    assert segments(out)[0] == (1, len(first)) and segments(out)[-1] == (1, len(second))
    assert [value for value, _ in segments(out)] == [1, 0, 1]
    # Token-in-token-out: the generated ids are in the response unchanged, and the second request's prompt is
    # exactly prompt + everything so far (no re-tokenization of the model's text).
    assert out.response_ids[: len(first)] == first and out.response_ids[-len(second):] == second
    assert server.prompts[1] == out.prompt_ids + out.response_ids[: -len(second)]
    tool_text = chat_tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "<|im_start|>tool\n5<|im_end|>" in tool_text
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if m == 0)
    assert out.num_turns == 3 and out.metrics["tool_calls"] == 1 and out.metrics["tool_errors"] == 0
    assert out.metrics["tool_latency_s/calculator"] >= 0 and not out.truncated
    assert "<tools>" in chat_tokenizer.decode(out.prompt_ids)  # SmolLM2's template ignores tools: we add them


@pytest.mark.parametrize("bad", ["<tool_call>{not json</tool_call>", call("no_such_tool", x=1),
                                 call("calculator", expr="1+1"), call("calculator", expression="9**9**9")])
def test_bad_tool_calls_become_error_messages(chat_tokenizer, bad):
    server = ScriptedServer(chat_tokenizer, [bad, "Sorry."])
    ctx = context(chat_tokenizer, server, tools={"calculator": CalculatorTool()})
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r"))
    tool_text = chat_tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "rror" in tool_text, tool_text
    assert out.metrics["tool_errors"] == out.metrics["tool_calls"] == 1 and len(server.outputs) == 2


def test_turn_and_length_limits(chat_tokenizer):
    looping = [call("calculator", expression="1 + 1")] * 10
    server = ScriptedServer(chat_tokenizer, looping)
    ctx = context(chat_tokenizer, server, tools={"calculator": CalculatorTool()}, max_assistant_turns=3)
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r"))
    assert len(server.outputs) == 3 and out.metrics["tool_calls"] == 3
    budget = 60
    short = context(chat_tokenizer, ScriptedServer(chat_tokenizer, looping), response_length=budget,
                    tools={"calculator": CalculatorTool()})
    out = asyncio.run(ToolAgentLoop(short).run(list(QUESTION), PARAMS, request_id="r"))
    assert len(out.response_ids) == budget and out.truncated
    # verl's default max_assistant_turns=None: no turn limit, the response length ends the trajectory
    unlimited = context(chat_tokenizer, ScriptedServer(chat_tokenizer, looping), response_length=400,
                        tools={"calculator": CalculatorTool()}, max_assistant_turns=None)
    out = asyncio.run(ToolAgentLoop(unlimited).run(list(QUESTION), PARAMS, request_id="r"))
    assert out.metrics["assistant_turns"] > 3 and out.truncated and len(out.response_ids) == 400


def test_parallel_call_limit(chat_tokenizer):
    many = "".join(call("calculator", expression=f"{i} + 1") for i in range(3))
    server = ScriptedServer(chat_tokenizer, [many, "ok"])
    ctx = context(chat_tokenizer, server, tools={"calculator": CalculatorTool()}, max_parallel_calls=2)
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r"))
    tool_text = chat_tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "\n1<|im_end|>" in tool_text and "\n2<|im_end|>" in tool_text and "at most 2 tool calls" in tool_text
    assert out.metrics["tool_calls"] == 3 and out.metrics["tool_errors"] == 1  # the third was refused


class HangingTool(BaseTool):
    """A tool whose call never finishes (a stalled service); its config sets a short timeout_s."""

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.from_dict({"type": "function", "function": {
            "name": "hang", "description": "Never answers.", "parameters": {"type": "object", "properties": {}}}})

    async def invoke(self, instance, parameters, **kwargs):
        await asyncio.Event().wait()


class UnreachableServiceTool(HangingTool):
    """A tool whose service is down: every call reports `status: server_error`, as the sandbox tool does."""

    async def invoke(self, instance, parameters, **kwargs):
        return ToolResponse(text="[the code could not be run: connection refused]"), 0.0, {"error": True,
                                                                                           "status": "server_error"}


def test_a_tool_whose_service_is_down_is_counted_apart_and_warned_once(chat_tokenizer, monkeypatch, caplog):
    """A dead code server turned every call into an error reply, mixed into tool/error_rate with the model's own
    failing programs and never logged."""
    from hybridflow.agents import tool_agent

    monkeypatch.setattr(tool_agent, "_warned", set())
    server = ScriptedServer(chat_tokenizer, [call("hang"), call("hang"), "gave up"])
    ctx = context(chat_tokenizer, server, tools={"hang": UnreachableServiceTool()})
    with caplog.at_level("WARNING", logger="hybridflow.agents.tool_agent"):
        out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r"))
    assert out.metrics["tool_server_errors"] == 2 and out.metrics["tool_errors"] == 2
    assert agent_metrics([out])["tool/server_errors"] == 2.0
    assert caplog.text.count("could not reach its service") == 1 and "connection refused" in caplog.text


def test_a_stalled_tool_call_times_out_and_the_other_loops_keep_running(chat_tokenizer):
    tools = {"hang": HangingTool({"timeout_s": 0.3}), "calculator": CalculatorTool()}
    stalled = ScriptedServer(chat_tokenizer, [call("hang"), "Sorry."])
    busy = ScriptedServer(chat_tokenizer, [call("calculator", expression=f"{i} + 1") for i in range(4)] + ["done"])

    async def both():
        start = asyncio.get_running_loop().time()
        outs = await asyncio.gather(
            ToolAgentLoop(context(chat_tokenizer, stalled, tools=tools)).run(list(QUESTION), PARAMS, request_id="a"),
            ToolAgentLoop(context(chat_tokenizer, busy, tools=tools)).run(list(QUESTION), PARAMS, request_id="b"))
        return outs, asyncio.get_running_loop().time() - start

    (hung, other), elapsed = asyncio.run(both())
    assert hung.metrics["tool_timeouts"] == hung.metrics["tool_errors"] == 1 and len(stalled.outputs) == 2
    tool_text = chat_tokenizer.decode([t for t, m in zip(hung.response_ids, hung.response_mask) if m == 0])
    assert "took longer than 0.3 s and was stopped" in tool_text, tool_text
    assert other.metrics["tool_calls"] == 4 and other.metrics["tool_timeouts"] == 0 and len(busy.outputs) == 5
    assert elapsed < 0.3 + 10.0, elapsed  # the stalled call ends at its timeout, not never
    assert agent_metrics([hung, other])["tool/timeouts"] == 1.0


def test_interaction_gives_feedback_until_correct(chat_tokenizer, tmp_path):
    config = tmp_path / "interaction.yaml"
    config.write_text("interaction:\n  - name: feedback\n    type: answer_feedback\n")
    interactions = load_interactions(config)
    assert isinstance(interactions["feedback"], AnswerFeedbackInteraction)
    server = ScriptedServer(chat_tokenizer, ["#### 4", "#### 5", "never asked"])
    ctx = context(chat_tokenizer, server, interactions=interactions)
    kwargs = {"name": "feedback", "data_source": "openai/gsm8k", "ground_truth": "5"}
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r", interaction_kwargs=kwargs))
    assert len(server.outputs) == 2 and out.reward_score == 1.0
    assert [value for value, _ in segments(out)] == [1, 0, 1]
    assert "incorrect" in chat_tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert out.metrics["user_turns"] == 1
    with pytest.raises(ValueError, match="interaction_config_path"):
        asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r", interaction_kwargs={"name": "x"}))


@pytest.mark.parametrize("scorer_fault", ["raises", "hangs", "hangs_in_c", "not_a_number"])
def test_an_interaction_whose_scorer_fails_scores_zero_and_the_other_loops_keep_running(
    chat_tokenizer, monkeypatch, caplog, scorer_fault
):
    """The answer_feedback interaction scores in a scorer process within `score_timeout_s`: a scorer that raises
    (it did on MATH rows ending in `\\boxed `, failing the whole rollout step), hangs (in C too: its process is
    killed), or returns NaN scores the turn 0, is counted (`interaction_score_errors`), and the trajectory goes on;
    other rows never wait on it."""
    import time

    from hybridflow.agents import interactions as interactions_module
    from tests.agents import faulty_scorers

    scorer = getattr(faulty_scorers, scorer_fault)
    monkeypatch.setattr(interactions_module, "resolve_scorer", lambda data_source: scorer)
    feedback = AnswerFeedbackInteraction({"score_timeout_s": 0.3})
    server = ScriptedServer(chat_tokenizer, ["\\boxed ", "\\boxed $", "never asked"])
    ctx = context(chat_tokenizer, server, interactions={"feedback": feedback})
    kwargs = {"name": "feedback", "data_source": "lighteval/MATH", "ground_truth": "5"}
    ticks: list[float] = []

    async def ticker():
        for _ in range(20):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    async def both():
        loop = ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r", interaction_kwargs=kwargs)
        out, _ = await asyncio.gather(loop, ticker())
        return out

    from hybridflow.agents import tool_agent

    monkeypatch.setattr(tool_agent, "_warned", set())
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="hybridflow.agents.tool_agent"):
        out = asyncio.run(both())  # ends when its worker threads do: a scorer thread stuck in C held it 30 s
    feedback._pool.close()
    assert time.monotonic() - start < 15.0, "the stuck scorer's process was killed, not waited for"
    assert out.reward_score == 0.0 and out.extra_fields["turn_scores"] == [0.0] * len(out.extra_fields["turn_scores"])
    assert out.metrics["interaction_score_errors"] == out.metrics["user_turns"] >= 1
    # the batch's metric and one warning with the error say the zeros are the scorer's, not the answers'
    assert agent_metrics([out, out])["interaction/score_errors"] == 2 * out.metrics["interaction_score_errors"]
    assert caplog.text.count("(counted in interaction/score_errors; first error only)") == 1
    assert "AnswerFeedbackInteraction" in caplog.text
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 1.5  # never the hung scorer's 3 s: the loop did not wait


def test_a_loop_that_raises_stops_the_step_naming_its_row_and_cancels_the_others(chat_tokenizer, monkeypatch):
    """A bug in an agent loop or its tools stops generate_sequences with the row, and the other rows' loops are
    cancelled rather than left running."""
    started, cancelled = [], []

    class Broken(SingleTurnAgentLoop):
        async def run(self, messages, sampling_params, **kwargs):
            started.append(kwargs["request_id"])
            if len(started) == 2:
                raise KeyError("tool state")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(kwargs["request_id"])
                raise

    from hybridflow.agents.base import AGENT_LOOPS

    monkeypatch.setitem(AGENT_LOOPS._entries, "broken_for_test", Broken)
    manager = AgentLoopManager(FakeWorkerGroup(ScriptedServer(chat_tokenizer, [])), RolloutConfig(),
                               chat_tokenizer, response_length=8)
    raw = np.empty(3, dtype=object)
    raw[:] = [list(QUESTION)] * 3
    names = np.array(["broken_for_test"] * 3, dtype=object)
    prompts = DataProto.from_dict(tensors={"index": torch.arange(3)},
                                  non_tensors={"raw_prompt": raw, "agent_name": names})
    with pytest.raises(RuntimeError, match=r"agent loop 'broken_for_test' raised on row 1 of the batch: "
                                           r"KeyError: 'tool state'"):
        manager.generate_sequences(prompts)
    assert len(cancelled) == 2


def test_single_turn_and_batch_layout(chat_tokenizer):
    server = ScriptedServer(chat_tokenizer, ["Five.", "It is 5, because two plus three is five, as anyone who counts on their fingers will quickly see."])
    ctx = context(chat_tokenizer, server, response_length=16)
    outs = [asyncio.run(SingleTurnAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id=str(i))) for i in range(2)]
    assert outs[1].truncated and not outs[0].truncated and len(outs[1].response_ids) == 16
    tool_like = AgentLoopOutput(prompt_ids=[7, 8, 9], response_ids=[1, 2, 3, 4], response_mask=[1, 0, 0, 1],
                                response_logprobs=[-1.0, 0.0, 0.0, -2.0], num_turns=3)
    tool_like.metrics["tool_calls"] = 2
    batch = build_output([*outs, tool_like], pad_token_id=0, response_length=16)
    width = max(len(o.prompt_ids) for o in outs)
    assert batch.batch["prompts"].shape == (3, width) and batch.batch["responses"].shape == (3, 16)
    row = batch.batch
    assert row["response_mask"][2, :5].tolist() == [1, 0, 0, 1, 0]
    assert row["attention_mask"][2, width:width + 5].tolist() == [1, 1, 1, 1, 0]  # tool tokens are attended
    assert row["prompts"][2, -3:].tolist() == [7, 8, 9] and (row["prompts"][2, :-3] == 0).all()
    assert row["position_ids"][2, width - 3:width + 4].tolist() == list(range(7))
    assert torch.equal(row["rollout_log_probs"][2, :4], torch.tensor([-1.0, 0.0, 0.0, -2.0]))
    assert list(batch.non_tensor_batch["__num_turns__"]) == [1, 1, 3]
    assert list(batch.non_tensor_batch["__tool_calls__"]) == [0, 0, 2]
    wide = build_output([*outs, tool_like], pad_token_id=0, response_length=16, prompt_length=width + 5)
    assert wide.batch["prompts"].shape == (3, width + 5)  # padded to the configured prompt length, as verl's loop
    assert torch.equal(wide.batch["prompts"][:, 5:], batch.batch["prompts"])
    assert (wide.batch["prompts"][:, :5] == 0).all()
    assert agent_columns(batch) == {"num_turns": [1.0, 1.0, 3.0], "tool_calls": [0.0, 0.0, 2.0],
                                    "tool_used": [0.0, 0.0, 1.0]}
    metrics = agent_metrics([*outs, tool_like])
    assert metrics["num_turns/max"] == 3 and metrics["agent/truncated"] == pytest.approx(1 / 3)
    assert metrics["tool_calls/used_ratio"] == pytest.approx(1 / 3)
    assert metrics["tool_calls/mean"] == pytest.approx(2 / 3)


async def _nothing_to_abort() -> int:
    return 0


class FakeWorkerGroup:
    """The generation-server side of a worker group, with one scripted replica."""

    def __init__(self, server) -> None:
        self.server = server

    def direct_callers(self, name: str, concurrency_group: str | None = None):
        if name == "abort_generation":
            assert concurrency_group == CONTROL_GROUP  # never behind the requests' threads
            return [getattr(self.server, "abort", _nothing_to_abort)]
        assert name == "generate_tokens"
        return [self.server]

    def wake_up_rollout_server(self):
        return [{"timing_s/update_weights": 0.0}]

    def sleep_rollout_server(self):
        return [{}]


def test_manager_samples_with_the_rollout_config_or_its_val_kwargs(chat_tokenizer):
    """Training rows use `rollout`'s sampling, validation rows `rollout.val_kwargs` (SamplingParams.from_config)."""
    seen: list[SamplingParams] = []
    scripted = ScriptedServer(chat_tokenizer, [])

    async def server(request_id, prompt_ids, params):
        seen.append(params)
        return await scripted(request_id, prompt_ids, params)

    rollout = RolloutConfig(temperature=0.7, top_p=0.9, n=4, val_kwargs=SamplingConfig(temperature=0.0, do_sample=True))
    manager = AgentLoopManager(FakeWorkerGroup(server), rollout, chat_tokenizer, response_length=24)
    raw = np.empty(2, dtype=object)
    raw[0], raw[1] = list(QUESTION), list(QUESTION)
    prompts = DataProto.from_dict(tensors={"index": torch.arange(2)}, non_tensors={"raw_prompt": raw})
    out = manager.generate_sequences(prompts)
    assert out.batch["responses"].shape == (2, 24) and "num_turns/mean" in out.meta_info["metrics"]
    assert seen == [SamplingParams(temperature=0.7, top_p=0.9, n=1, max_new_tokens=24)] * 2  # n: rows repeated
    seen.clear()
    prompts.meta_info["validate"] = True
    manager.generate_sequences(prompts)
    # val_kwargs asks for greedy with temperature 0: normalised to do_sample=False, log-probs at temperature 1
    assert [(p.do_sample, p.log_prob_temperature, p.max_new_tokens) for p in seen] == [(False, 1.0, 24)] * 2


def test_server_manager_is_sticky_and_balances_new_requests():
    seen: list[tuple[int, str]] = []

    def replica(index: int):
        async def serve(request_id, prompt_ids, params):
            seen.append((index, request_id))
            await asyncio.sleep(0.01)
            return TokenOutput([1], [0.0], "stop")
        return serve

    manager = AsyncLLMServerManager([replica(0), replica(1)])

    async def conversations():
        async def talk(cid: str):
            for _ in range(3):
                await manager.generate(cid, [1], PARAMS)
        await asyncio.gather(*(talk(f"c{i}") for i in range(4)))

    asyncio.run(conversations())
    by_conversation: dict[str, set[int]] = {}
    for index, cid in seen:
        by_conversation.setdefault(cid, set()).add(index)
    assert all(len(replicas) == 1 for replicas in by_conversation.values())  # sticky
    assert sorted(np.bincount([next(iter(r)) for r in by_conversation.values()])) == [2, 2]  # balanced


def test_truncate_text_sides():
    text = "abcdefghijklmnopqrstuvwxyz" * 4
    assert truncate_text("short", 10, "middle") == "short"
    for side in ("left", "middle", "right"):
        cut = truncate_text(text, 40, side)
        assert len(cut) == 40 and "(truncated)" in cut
    assert truncate_text(text, 40, "right").startswith("abc") and truncate_text(text, 40, "left").endswith("xyz")


def test_tool_rewards_travel_with_the_trajectory(chat_tokenizer):
    """Each tool call's step reward is kept in call order (verl's `tool_rewards`), for the reward function."""
    from hybridflow.tools.gsm8k_answer import NO_GAIN_PENALTY, Gsm8kAnswerTool

    turns = [call("calc_gsm8k_reward", answer="4"), call("calc_gsm8k_reward", answer="5"),
             call("calc_gsm8k_reward", answer="5"), "#### 5"]
    ctx = context(chat_tokenizer, ScriptedServer(chat_tokenizer, turns), tools={"calc_gsm8k_reward": Gsm8kAnswerTool()})
    tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}}
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r", tools_kwargs=tools_kwargs))
    assert out.extra_fields == {"tool_rewards": [NO_GAIN_PENALTY, 0.0, NO_GAIN_PENALTY], "turn_scores": []}
    batch = build_output([out], chat_tokenizer.pad_token_id, 512)
    assert batch.non_tensor_batch["tool_extra_fields"][0] == out.extra_fields


def test_verl_s_gsm8k_interaction_file_builds_its_interaction(chat_tokenizer, tmp_path):
    """verl's gsm8k interaction config (class_name verl.interactions...Gsm8kInteraction) loads unchanged; the row's
    interaction_kwargs (name, query, ground_truth, as verl's preprocessing writes them) drive it: strict extraction,
    verl's messages, the turn scores kept for the reward function."""
    config = tmp_path / "gsm8k_interaction_config.yaml"
    config.write_text('interaction:\n  - name: "gsm8k"\n    class_name: "verl.interactions.gsm8k_interaction.'
                      'Gsm8kInteraction"\n    config: {}\n')
    interactions = load_interactions(config)
    server = ScriptedServer(chat_tokenizer, ["The answer is 5.", "#### 5", "never asked"])  # strict: needs ####
    ctx = context(chat_tokenizer, server, interactions=interactions)
    kwargs = {"name": "gsm8k", "query": "What is 2 + 3?", "ground_truth": "5"}
    out = asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r", interaction_kwargs=kwargs))
    assert len(server.outputs) == 2 and out.reward_score == 1.0 and out.extra_fields["turn_scores"] == [0.0, 1.0]
    feedback = chat_tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "Your response is incorrect! You need to reflect on your answer and try again." in feedback
    with pytest.raises(ValueError, match="interaction_kwargs.ground_truth"):
        asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r2", interaction_kwargs={"name": "gsm8k"}))
    other = tmp_path / "other.yaml"
    other.write_text("interaction:\n  - name: x\n    class_name: verl.interactions.other.Other\n")
    with pytest.raises(ValueError, match=r"builds only \['verl.interactions.gsm8k_interaction.Gsm8kInteraction'\]"):
        load_interactions(other)


@pytest.mark.parametrize(("text", "error"), [
    ("interaction:\n  - name: f\n    type: answer_feedbak\n", r"interaction\[0\]: interaction type 'answer_feedbak' is "
                                                             r"unknown; known: \["),
    ("interaction:\n  - name: f\n    typ: answer_feedback\n", r"interaction\[0\] has unknown keys \['typ'\]"),
    ("interaction:\n  - name: f\n    type: answer_feedback\n    config: {incorect_message: x}\n",
     r"config keys \['incorect_message'\] are not read by AnswerFeedbackInteraction"),
    ("interaction: [\n", r"is not valid YAML"),
])
def test_an_interaction_file_s_mistakes_are_named(tmp_path, text, error):
    """A misspelt type failed after Ray with a bare KeyError; misspelt keys were accepted and never read."""
    path = tmp_path / "interaction.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_interactions(path)
