"""The hermes tool-call parser: well-formed, multiple, string-argument and malformed calls (never raises)."""

from __future__ import annotations

import pytest

from hybridflow.agents.tool_parsers import TOOL_PARSERS, HermesToolParser, ParsedToolCalls
from hybridflow.tools import FunctionCall


@pytest.fixture
def parser() -> HermesToolParser:
    return TOOL_PARSERS.get("hermes")()


def test_single_call(parser):
    text = ('Let me compute that.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n'
            '</tool_call>')
    assert parser.parse(text) == ParsedToolCalls(
        content="Let me compute that.", calls=[FunctionCall(name="calculator", arguments={"expression": "6*7"})],
        errors=[])


def test_multiple_calls_and_string_arguments(parser):
    text = ('<tool_call>\n{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>\n'
            'and\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>\n'
            '<tool_call>{"name": "now"}</tool_call>')
    parsed = parser.parse(text)
    assert parsed.calls == [FunctionCall(name="search", arguments={"query": "capital of France"}),
                            FunctionCall(name="calculator", arguments={"expression": "1+1"}),
                            FunctionCall(name="now", arguments={})]
    assert parsed.content == "and" and parsed.errors == []


def test_no_calls(parser):
    assert parser.parse("  The answer is 42.\n") == ParsedToolCalls(content="The answer is 42.")


@pytest.mark.parametrize(("body", "error"), [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "tool call 1: invalid JSON (Expecting ',' delimiter"),
    ('["calculator"]', "tool call 1: expected a JSON object like"),
    ('{"arguments": {}}', "tool call 1: 'name' must be the tool's name as a non-empty string, got None"),
    ('{"name": "", "arguments": {}}', "tool call 1: 'name' must be the tool's name as a non-empty string, got ''"),
    ('{"name": "calc", "arguments": {}, "id": 3}', "tool call 1: unknown keys ['id']; a call has only 'name'"),
    ('{"name": "calc", "arguments": "{x: 1}"}', "tool call 1: 'arguments' is a string but not valid JSON"),
    ('{"name": "calc", "arguments": [1, 2]}', "tool call 1: 'arguments' must be a JSON object"),
])
def test_malformed_calls_become_errors(parser, body, error):
    parsed = parser.parse(f"before <tool_call>{body}</tool_call> after")
    assert parsed.calls == [] and parsed.content == "before  after"
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith(error)


@pytest.mark.parametrize(("body", "error"), [
    ("[" * 5000, "tool call 1: invalid JSON (nested too deeply)"),
    ('{"name": "calc", "arguments": ' + '{"a":' * 3000 + "1" + "}" * 3001, "tool call 1: invalid JSON (nested too deep"),
    ('{"name": "calc", "arguments": "' + "[" * 5000 + '"}', "tool call 1: 'arguments' is a string but not valid JSON "
                                                          "(nested too deeply)"),
    ('{"name": "calc", "arguments": {"x": ' + "9" * 5000 + "}}", "tool call 1: invalid JSON (Exceeds the limit"),
])
def test_hostile_calls_become_errors_and_never_raise(parser, body, error):
    """About 500 tokens of `[` (or a 5,000-digit integer) made json.loads raise RecursionError (ValueError) out
    of the parser, which failed the whole rollout step; they are malformed calls like any other."""
    parsed = parser.parse(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.errors[0].startswith(error), parsed.errors


def test_bad_call_does_not_hide_good_ones(parser):
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{oops}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>')
    parsed = parser.parse(text)
    assert [call.name for call in parsed.calls] == ["a", "b"]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("tool call 2: invalid JSON")


def test_unterminated_and_stray_tags(parser):
    truncated = parser.parse('Thinking.\n<tool_call>\n{"name": "calculator", "arguments": {"expr')
    assert truncated.calls == [] and truncated.content == "Thinking."
    assert truncated.errors == ["tool call 1: <tool_call> is not closed; end each call with </tool_call>"]

    reopened = parser.parse('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>')
    assert reopened.calls == [FunctionCall(name="b")]
    assert reopened.errors == ["tool call 1: <tool_call> is not closed; end each call with </tool_call>"]

    stray = parser.parse('{"name": "a"}</tool_call> done')
    assert stray.calls == [] and stray.content == '{"name": "a"} done'
    assert stray.errors[0].startswith("found </tool_call> without a matching <tool_call>")


def test_registry():
    assert "hermes" in TOOL_PARSERS.names()
    with pytest.raises(KeyError, match="unknown tool parser 'mistral'; known: \\['hermes'\\]"):
        TOOL_PARSERS.get("mistral")
