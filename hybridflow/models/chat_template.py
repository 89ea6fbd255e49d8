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

VISION_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML whose message content may be a list of {"type": "text"|"image"|"video"} entries (Qwen2-VL's layout,
without its default system prompt); needs `VISION_SPECIAL_TOKENS` besides ChatML's."""

VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision tokens: an image is `<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>`."""
