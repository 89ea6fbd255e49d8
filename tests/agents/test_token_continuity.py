"""Multi-turn token continuity: each turn's prompt is exactly the previous prompt, the tokens the model generated
and the new messages' tokens, never a re-tokenisation; templates that rewrite history are refused, and templates
that drop thinking blocks from history keep the generated tokens (the documented handling)."""

from __future__ import annotations

import asyncio
import copy

import pytest

from hybridflow.agents.chat import ChatEncoder
from hybridflow.agents.tool_agent import ToolAgentLoop
from hybridflow.tools.calculator import CalculatorTool
from tests.agents.test_agent_loops import PARAMS, QUESTION, ScriptedServer, call, context

THINKING_TEMPLATE = (  # ChatML that, like Qwen3's, drops the thinking block of earlier assistant turns
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1].strip() %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REWRITING_TEMPLATE = THINKING_TEMPLATE.replace("c.split('</think>')[-1].strip()", "'(an earlier answer)'")


def with_template(tokenizer, template: str):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def run_tool_agent(tokenizer, turns: list[str]):
    server = ScriptedServer(tokenizer, turns)
    ctx = context(tokenizer, server, tools={"calculator": CalculatorTool()})
    return server, asyncio.run(ToolAgentLoop(ctx).run(list(QUESTION), PARAMS, request_id="r"))


def assert_continuous(server: ScriptedServer, out) -> None:
    """Turn k+1's prompt = turn k's prompt + its generated ids + the follow-up; the trainer's ids and mask match."""
    for k in range(len(server.prompts) - 1):
        before, after, generated = server.prompts[k], server.prompts[k + 1], server.outputs[k]
        assert after[: len(before)] == before and after[len(before): len(before) + len(generated)] == generated
    assert server.prompts[0] == out.prompt_ids
    assert out.prompt_ids + out.response_ids == server.prompts[-1] + server.outputs[-1]
    model_tokens = [token for token, mask in zip(out.response_ids, out.response_mask) if mask == 1]
    assert model_tokens == [token for ids in server.outputs for token in ids]  # mask 1 exactly on generated ids


def test_smollm2_chatml_three_turns_are_append_only(chat_tokenizer):
    server, out = run_tool_agent(chat_tokenizer, [
        call("calculator", expression="2 + 3"), call("calculator", expression="5 * 2"), "The answer is 5."])
    assert len(server.prompts) == 3
    assert_continuous(server, out)


def test_a_template_dropping_thinking_from_history_keeps_the_generated_tokens(chat_tokenizer):
    tokenizer = with_template(chat_tokenizer, THINKING_TEMPLATE)
    server, out = run_tool_agent(tokenizer, ["<think>I need the tool</think>" + call("calculator", expression="2 + 3"),
                                             "The answer is 5."])
    assert_continuous(server, out)
    trajectory = tokenizer.decode(out.prompt_ids + out.response_ids)
    assert "<think>I need the tool</think>" in trajectory  # what the model produced is what the trainer sees
    conversation = [*QUESTION, {"role": "assistant", "content": "<think>I need the tool</think>" + call(
        "calculator", expression="2 + 3")}, {"role": "tool", "content": "5"}]
    rerendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert "I need the tool" not in rerendered  # re-rendering would have drifted from the sampled tokens


def test_a_template_that_rewrites_history_is_refused_with_the_reason(chat_tokenizer):
    tokenizer = with_template(chat_tokenizer, REWRITING_TEMPLATE)
    with pytest.raises(ValueError, match=r"renders earlier turns differently.*\(an earlier answer\)"):
        ChatEncoder(tokenizer)
