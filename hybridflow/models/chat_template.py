"""Chat templates that hybridflow supplies when a tokenizer has none (ChatML, as SmolLM2 and Qwen2 use)."""

from __future__ import annotations

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML without a default system prompt; needs the special tokens `<|im_start|>` and `<|im_end|>`."""

CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens a ChatML tokenizer must know: document end, turn start, turn end (= eos)."""
