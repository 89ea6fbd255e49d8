"""Tool-call parsers: from a model's generated text to `FunctionCall`s, the remaining content and errors.

Parsers are registered in `TOOL_PARSERS` and never raise on model output: a malformed call becomes a
message in `ParsedToolCalls.errors`, written so that it can be sent back to the model as feedback.

    parser = TOOL_PARSERS.get("hermes")()
    parsed = parser.parse(text)   # ParsedToolCalls(content=..., calls=[FunctionCall(...)], errors=[...])
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hybridflow.tools.schemas import FunctionCall
from hybridflow.utils.registry import Registry

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ParsedToolCalls", "ToolParser"]


@dataclass(kw_only=True)
class ParsedToolCalls:
    """The result of parsing one generated message."""

    content: str
    """The text with every tool-call block removed, stripped of surrounding whitespace."""

    calls: list[FunctionCall] = field(default_factory=list)
    """Well-formed calls, in the order they appear."""

    errors: list[str] = field(default_factory=list)
    """One message per malformed call (meant for the model); those calls are not in `calls`."""


class ToolParser:
    """Extracts tool calls from generated text; subclasses implement `parse` for one model family's format."""

    def parse(self, text: str) -> ParsedToolCalls:
        """Split `text` into content, calls and errors; never raises on malformed model output."""
        raise NotImplementedError(f"{type(self).__name__} must implement parse()")


TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool parser")
"""Format name -> `ToolParser` subclass (constructed without arguments)."""


@TOOL_PARSERS.register("hermes")
class HermesToolParser(ToolParser):
    """Hermes / Qwen format: `<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`, possibly several.

    `arguments` may be an object or a JSON string holding an object; a missing or null `arguments` is `{}`.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    _example = '{"name": "<tool name>", "arguments": {...}}'

    def parse(self, text: str) -> ParsedToolCalls:
        """Split `text` into content, calls and errors (see the class docstring for the format)."""
        pieces, blocks, errors = self._split(text)
        calls: list[FunctionCall] = []
        for number, body in blocks:
            call = self._parse_block(body, number, errors)
            if call is not None:
                calls.append(call)
        content = "".join(pieces)
        if self.close_tag in content:
            errors.append(f"found {self.close_tag} without a matching {self.open_tag}; wrap each call as "
                          f"{self.open_tag}{self._example}{self.close_tag}")
            content = content.replace(self.close_tag, "")
        return ParsedToolCalls(content=content.strip(), calls=calls, errors=errors)

    def _split(self, text: str) -> tuple[list[str], list[tuple[int, str]], list[str]]:
        """(content pieces, numbered complete block bodies, errors for unterminated blocks)."""
        pieces: list[str] = []
        blocks: list[tuple[int, str]] = []
        errors: list[str] = []
        pos, number = 0, 0
        while (start := text.find(self.open_tag, pos)) != -1:
            number += 1
            pieces.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            next_open = text.find(self.open_tag, body_start)
            if end == -1 or (next_open != -1 and next_open < end):
                errors.append(f"tool call {number}: {self.open_tag} is not closed; end each call with "
                              f"{self.close_tag}")
                pos = next_open if next_open != -1 else len(text)  # drop the unclosed block from content
                continue
            blocks.append((number, text[body_start:end]))
            pos = end + len(self.close_tag)
        pieces.append(text[pos:])
        return pieces, blocks, errors

    def _parse_block(self, body: str, number: int, errors: list[str]) -> FunctionCall | None:
        """The call in one block body, or None after appending an error message."""
        where = f"tool call {number}"
        data, problem = _decode_json(body)
        if problem is not None:
            errors.append(f"{where}: invalid JSON ({problem}); write {self._example} between {self.open_tag} and "
                          f"{self.close_tag}")
            return None
        if not isinstance(data, dict):
            errors.append(f"{where}: expected a JSON object like {self._example}, got {type(data).__name__}")
            return None
        unknown = sorted(set(data) - {"name", "arguments"})
        if unknown:
            errors.append(f"{where}: unknown keys {unknown}; a call has only 'name' and 'arguments'")
            return None
        name = data.get("name")
        if not isinstance(name, str) or not name.strip():
            errors.append(f"{where}: 'name' must be the tool's name as a non-empty string, got {name!r}")
            return None
        arguments = self._decode_arguments(data.get("arguments"), where, errors)
        return None if arguments is None else FunctionCall(name=name.strip(), arguments=arguments)

    @staticmethod
    def _decode_arguments(arguments: Any, where: str, errors: list[str]) -> dict[str, Any] | None:
        if arguments is None:
            return {}
        if isinstance(arguments, str):
            arguments, problem = _decode_json(arguments) if arguments.strip() else ({}, None)
            if problem is not None:
                errors.append(f"{where}: 'arguments' is a string but not valid JSON ({problem}); give a JSON "
                              f"object of argument name -> value")
                return None
        if not isinstance(arguments, dict):
            errors.append(f"{where}: 'arguments' must be a JSON object of argument name -> value, "
                          f"got {type(arguments).__name__}")
            return None
        return arguments


def _decode_json(text: str) -> tuple[Any, str | None]:
    """`json.loads(text)` and None, or None and what is wrong. Model output is untrusted: besides malformed JSON,
    nesting deeper than the interpreter's recursion limit raises RecursionError and an integer beyond Python's
    digit limit ValueError; each is a malformed call reported to the model, never an exception out of the parser."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"{err.msg} at line {err.lineno} column {err.colno}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as err:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        return None, str(err).split(";")[0]
