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
from tests.agents.scripted_server import PARAMS, QUESTION, ScriptedServer, call, context

THINKING_TEMPLATE = (  # ChatML that, like Qwen3's, drops the thinking block of earlier assistant turns
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1].strip() %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REWRITING_TEMPLATE = THINKING_TEMPLATE.replace("c.split('</think>')[-1].strip()", "'(an earlier answer)'")
# The shape of Qwen2.5's template: a default system prompt, `tools` rendered inside it, and tool results sent back
# as a user turn of <tool_response> blocks (consecutive tool messages share one turn).
QWEN25_STYLE_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = 'You are a helpful assistant.' %}{% set rest = messages %}{% endif %}"
    "{{ '<|im_start|>system\\n' + system }}"
    "{% if tools %}{{ '\\n\\n# Tools\\n\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nCall a function inside <tool_call></tool_call> tags.' }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% for m in rest %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The shape of Llama 3.1's template: bos, a dated system header, header tokens per turn, <|eot_id|> as the
# end of turn (and the model's eos), tool results as `ipython` turns, contents trimmed.
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n<|eot_id|>' }}"
    "{% for m in messages %}{% set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


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


def llama3_style(tokenizer):
    """SmolLM2's vocabulary with Llama 3's turn tokens added and `<|eot_id|>` as eos (the model's end of turn)."""
    tokenizer = with_template(tokenizer, LLAMA3_STYLE_TEMPLATE)
    tokenizer.add_special_tokens({"eos_token": "<|eot_id|>",
                                  "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    return tokenizer


@pytest.mark.parametrize(
    ("family", "tool_turn"),
    [("qwen2.5", "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
     ("llama3", "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant")],
)
def test_qwen_and_llama_style_templates_are_append_only_over_three_turns(chat_tokenizer, family, tool_turn):
    """Each family's own end of turn, tool turn and system prompt: the trainer's ids are the prompts the server saw
    plus what it generated, token for token, and the tool results are rendered the family's way."""
    if family == "llama3":
        tokenizer = llama3_style(chat_tokenizer)
    else:
        tokenizer = with_template(chat_tokenizer, QWEN25_STYLE_TEMPLATE)
    encoder = ChatEncoder(tokenizer, tools=[CalculatorTool().tool_schema.to_dict()])
    assert encoder.turn_end_text == ("<|eot_id|>" if family == "llama3" else "<|im_end|>\n")
    # Qwen's template renders `tools` itself; the Llama-style one ignores them, so the loop adds its tool prompt.
    assert (encoder.tool_prompt is None) == (family == "qwen2.5")
    server, out = run_tool_agent(tokenizer, [
        call("calculator", expression="2 + 3"), call("calculator", expression="2 + 3"), "The answer is 5."])
    assert len(server.prompts) == 3
    assert_continuous(server, out)
    trajectory = tokenizer.decode(out.prompt_ids + out.response_ids)
    assert trajectory.count(tool_turn) == 2, trajectory
    # The model's own eos closed each turn: nothing was inserted between a generated turn and the next message.
    for ids in server.outputs[:-1]:
        assert ids[-1] == tokenizer.eos_token_id
