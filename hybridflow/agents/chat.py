"""Incremental chat-template encoding for token-in-token-out agent loops.

A trajectory is built from token ids only: the prompt is rendered once, the model's tokens are appended as
generated (never decoded and re-encoded: that could change them, and the trainer must score exactly the
tokens that were sampled), and each later message (tool output, user feedback) is appended as the ids of
the text the chat template adds for it. That text is found by rendering a fixed two-message conversation
with and without the new messages and taking the difference, so the template's own system-prompt logic
is never repeated. If the model's turn ended without the template's end-of-turn text (a length stop, or a
stop at a tool-call tag), the missing end-of-turn text is added in front (mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_ANCHOR_USER = {"role": "user", "content": "ping"}
_ANCHOR_ASSISTANT = {"role": "assistant", "content": "pong"}


class ChatEncoder:
    """Renders prompts and follow-up messages to token ids with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.tool_prompt: str | None = None
        """Tool instructions added to the system message when the template itself ignores `tools`."""
        if self.tools and self._render([_ANCHOR_USER], True) == self._render([_ANCHOR_USER], True, tools=None):
            self.tool_prompt = hermes_tool_prompt(self.tools)
        anchor_text = self._render([_ANCHOR_USER, _ANCHOR_ASSISTANT], add_generation_prompt=False)
        content_end = anchor_text.rindex(_ANCHOR_ASSISTANT["content"]) + len(_ANCHOR_ASSISTANT["content"])
        self._anchor_text = anchor_text
        # Refuse at once a template that re-renders past turns once a later message follows (e.g. rewrites or drops
        # earlier assistant content): appended ids would no longer be what the template means. Templates that only
        # drop thinking blocks from history pass (the anchor has none): the trajectory keeps the generated tokens.
        self._check_append_only(self._render([_ANCHOR_USER, _ANCHOR_ASSISTANT, _ANCHOR_USER], True))
        self.turn_end_text = anchor_text[content_end:]
        """What the template writes after an assistant message's content (e.g. '<|im_end|>\\n')."""

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool, tools: Any = "default") -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools if tools == "default" else tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of the conversation so far plus the assistant generation prompt."""
        messages = list(messages)
        if self.tool_prompt is not None:
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + self.tool_prompt}
            else:
                messages.insert(0, {"role": "system", "content": self.tool_prompt})
        return self._encode_text(self._render(messages, add_generation_prompt=True))

    def encode_followup(self, messages: Sequence[dict], model_turn_text: str) -> list[int]:
        """Ids to append after a model turn: the rest of its end-of-turn text, `messages`, the generation prompt.

        model_turn_text: the decoded model turn (special tokens kept), used to see which end-of-turn text
        the model already produced.
        """
        full = self._render([_ANCHOR_USER, _ANCHOR_ASSISTANT, *messages], add_generation_prompt=True)
        self._check_append_only(full)
        return self._encode_text(self.missing_turn_end(model_turn_text) + full[len(self._anchor_text) :])

    def _check_append_only(self, rendered: str) -> None:
        if not rendered.startswith(self._anchor_text):
            raise ValueError(
                "the chat template renders earlier turns differently once later messages follow (rendered "
                f"{self._anchor_text!r} alone, but {rendered[: len(self._anchor_text) + 40]!r} with a later message); "
                "multi-turn agent loops append token ids and need a template whose past turns do not change"
            )

    def missing_turn_end(self, model_turn_text: str) -> str:
        """The part of the template's end-of-turn text that `model_turn_text` does not already end with."""
        stripped = model_turn_text.rstrip(" ")
        for cut in range(len(self.turn_end_text), 0, -1):
            if stripped.endswith(self.turn_end_text[:cut]):
                return self.turn_end_text[cut:]
        return self.turn_end_text


def hermes_tool_prompt(tools: Sequence[dict]) -> str:
    """Tool instructions in the hermes format, for chat templates that do not render `tools` themselves."""
    import json

    listing = "\n".join(json.dumps(tool) for tool in tools)
    return (
        "You may call one or more functions to help with the user's request. The functions are:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> "
        'tags, for example:\n<tool_call>\n{"name": "<function name>", "arguments": {"<argument>": "<value>"}}\n'
        "</tool_call>\nThe result comes back in a tool message."
    )
