"""SFTDataset: chat-templated samples, loss masks on assistant tokens only (hand-checked), truncation, padding."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data.config import MultiturnConfig, SFTDataConfig
from hybridflow.data.sft_dataset import SFTDataset, tokenize_conversation
from hybridflow.models import build_local_tokenizer
from hybridflow.utils.config import ConfigFieldError, build_config

MULTITURN = SFTDataConfig(multiturn=MultiturnConfig(enable=True))
CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "x"},
    {"role": "tool", "content": "T"},
    {"role": "assistant", "content": "ok"},
]


@pytest.fixture(scope="module")
def local_tokenizer():
    return build_local_tokenizer()


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_multiturn_mask_hand_checked_on_smollm2(smollm2_tokenizer):
    """SmolLM2's template adds its default system prompt (tokens 0-20). Rendered and tokenized:
    21-32 `<|im_start|>user\\nWhat is 2+3?<|im_end|>\\n`, 33-36 `<|im_start|>assistant\\n`, 37 `5`, 38 `<|im_end|>`,
    39 `\\n`, 40-45 user `x`, 46-51 tool `T`, 52-55 `<|im_start|>assistant\\n`, 56 `ok`, 57 `<|im_end|>`, 58 `\\n`.
    Trained: exactly the assistant contents and their `<|im_end|>`; never the headers, the user or the tool turn."""
    ids, mask = tokenize_conversation(smollm2_tokenizer, CONVERSATION)
    assert len(ids) == len(mask) == 59
    assert [i for i, m in enumerate(mask) if m] == [37, 38, 56, 57]
    decode = smollm2_tokenizer.decode
    assert [decode([ids[i]]) for i in (37, 38, 56, 57)] == ["5", "<|im_end|>", "ok", "<|im_end|>"]
    assert decode(ids[33:37]) == "<|im_start|>assistant\n" and decode(ids[46:52]) == "<|im_start|>tool\nT<|im_end|>\n"
    # Segment-wise tokenization equals tokenizing the whole rendered conversation.
    text = smollm2_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_single_turn_rows_train_on_the_response_and_eos(local_tokenizer, tmp_path):
    rows = [
        {"prompt": "Calculate 5 - 33.", "response": "5 - 33 = -28. Answer: -28"},
        {"prompt": "Add 1 and 2", "response": "3"},
    ]
    dataset = SFTDataset(write(tmp_path / "a.parquet", rows), local_tokenizer, SFTDataConfig())
    item = dataset[0]
    ids, mask = item["input_ids"], item["loss_mask"]
    first = int(mask.nonzero()[0])
    assert local_tokenizer.decode(ids[:first]) == "<|im_start|>user\nCalculate 5 - 33.<|im_end|>\n<|im_start|>assistant\n"
    assert local_tokenizer.decode(ids[mask.bool()]) == "5 - 33 = -28. Answer: -28<|im_end|>"
    assert mask[first:].tolist() == [1] * (len(ids) - first - 1) + [0]  # the template's trailing "\n" is not trained
    assert item["attention_mask"].tolist() == [1] * len(ids)
    assert item["position_ids"].tolist() == list(range(len(ids)))

    # The same row with the prompt as RL-style chat messages, or nested in a dict column, gives the same sample.
    as_messages = [{"prompt": [{"role": "user", "content": "Calculate 5 - 33."}], "response": rows[0]["response"]}]
    nested = [{"extra_info": {"question": "Calculate 5 - 33.", "answer": rows[0]["response"]}}]
    for data, config in (
        (as_messages, SFTDataConfig()),
        (nested, SFTDataConfig(prompt_key="extra_info", prompt_dict_keys=["question"],
                               response_key="extra_info", response_dict_keys=["answer"])),
    ):
        other = SFTDataset(write(tmp_path / "b.parquet", data), local_tokenizer, config)[0]
        assert torch.equal(other["input_ids"], ids) and torch.equal(other["loss_mask"], mask)


def test_multiturn_rows_and_collate_right_pads(local_tokenizer, tmp_path):
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}]
    dataset = SFTDataset(write(tmp_path / "m.parquet", rows), local_tokenizer, MULTITURN)
    long, short = dataset[0], dataset[1]
    assert local_tokenizer.decode(long["input_ids"][long["loss_mask"].bool()]) == "5<|im_end|>ok<|im_end|>"
    # the conversation column is configurable (data.multiturn.messages_key)
    renamed = SFTDataConfig(multiturn=MultiturnConfig(enable=True, messages_key="conversation"))
    other = SFTDataset(write(tmp_path / "c.parquet", [{"conversation": CONVERSATION}]), local_tokenizer, renamed)[0]
    assert torch.equal(other["input_ids"], long["input_ids"]) and torch.equal(other["loss_mask"], long["loss_mask"])
    batch = dataset.collate([long, short])
    length = long["input_ids"].size(0)
    assert batch["input_ids"].shape == (2, length)
    num = short["input_ids"].size(0)
    assert batch["input_ids"][1, num:].eq(local_tokenizer.pad_token_id).all()
    for key in ("attention_mask", "loss_mask", "position_ids"):
        assert batch[key][1, num:].eq(0).all(), key
    assert torch.equal(batch["loss_mask"][1, :num], short["loss_mask"])


def test_truncation(local_tokenizer, tmp_path):
    path = write(tmp_path / "t.parquet", [{"prompt": "Calculate 5 - 33.", "response": "5 - 33 = -28. Answer: -28"}])
    full = SFTDataset(path, local_tokenizer, SFTDataConfig())[0]
    limit = full["input_ids"].size(0) - 3
    with pytest.raises(ValueError, match=r"t\.parquet: row 0: .* > data.max_length=" + str(limit)):
        SFTDataset(path, local_tokenizer, SFTDataConfig(max_length=limit))
    right = SFTDataset(path, local_tokenizer, SFTDataConfig(max_length=limit, truncation="right"))[0]
    assert torch.equal(right["input_ids"], full["input_ids"][:limit])
    left = SFTDataset(path, local_tokenizer, SFTDataConfig(max_length=limit, truncation="left"))[0]
    assert torch.equal(left["input_ids"], full["input_ids"][-limit:])
    assert left["loss_mask"][0] == 0 and torch.equal(left["loss_mask"][1:], full["loss_mask"][-limit + 1:])


def test_bad_rows_name_the_file_row_and_field(local_tokenizer, tmp_path):
    cases = [
        ([{"prompt": "hi"}], SFTDataConfig(), "row 0: field 'response' is missing"),
        ([{"prompt": "hi", "response": 3}], SFTDataConfig(), "field 'response' must be a str"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], MULTITURN, "no assistant message"),
        ([{"messages": "hi"}], MULTITURN, "field 'messages' must be a non-empty list"),
        ([{"q": {"a": 1}, "response": "x"}], SFTDataConfig(prompt_key="q", prompt_dict_keys=["b"]), "has no key 'b'"),
    ]
    for index, (rows, config, message) in enumerate(cases):
        path = write(tmp_path / f"bad{index}.parquet", rows)
        with pytest.raises(ValueError, match=message):
            SFTDataset(path, local_tokenizer, config)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        SFTDataset(str(tmp_path / "missing.parquet"), local_tokenizer, SFTDataConfig())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_length": 1}, r"^max_length=1 must be >= 2"),
    ({"prompt_key": ""}, r"^prompt_key/response_key must name columns"),
    ({"multiturn": MultiturnConfig(enable=True, messages_key="")}, r"^multiturn\.messages_key must name columns"),
    ({"micro_batch_size_per_gpu": 0}, r"^micro_batch_size_per_gpu=0 must be > 0"),
    ({"train_max_samples": 0}, r"^train_max_samples"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigFieldError, match=match):
        SFTDataConfig(**kwargs)


def test_config_built_from_values_checks_choices_and_nests_multiturn():
    values = {"multiturn": {"enable": True, "tools_key": "t"}, "prompt_dict_keys": "q"}
    built = build_config(SFTDataConfig, values, "data")
    assert built.multiturn == MultiturnConfig(enable=True, tools_key="t") and built.prompt_dict_keys == ["q"]
    with pytest.raises(ValueError, match=r"^data\.truncation='middle' is not one of \['error', 'left', 'right'\]"):
        build_config(SFTDataConfig, {"truncation": "middle"}, "data")
    with pytest.raises(ValueError, match=r"^data\.max_length=1 must be >= 2"):
        build_config(SFTDataConfig, {"max_length": 1}, "data")


def test_max_samples_keeps_the_first_rows(local_tokenizer, tmp_path):
    rows = [{"prompt": f"Add {n} and 1", "response": str(n + 1)} for n in range(5)]
    first, second = write(tmp_path / "a.parquet", rows[:3]), write(tmp_path / "b.parquet", rows[3:])
    everything = SFTDataset([first, second], local_tokenizer, SFTDataConfig())
    assert len(everything) == 5
    assert len(SFTDataset([first, second], local_tokenizer, SFTDataConfig(), max_samples=-1)) == 5
    assert len(SFTDataset([first, second], local_tokenizer, SFTDataConfig(), max_samples=50)) == 5
    for limit in (2, 4):  # within the first file, and across both
        limited = SFTDataset([first, second], local_tokenizer, SFTDataConfig(), max_samples=limit)
        assert len(limited) == limit
        for index in range(limit):
            assert torch.equal(limited[index]["input_ids"], everything[index]["input_ids"])


def test_templates_that_rewrite_earlier_turns_are_rejected(tmp_path):
    tokenizer = build_local_tokenizer()
    # Renders only the last message: the prefix of a conversation is not a prefix of its rendering.
    tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ValueError, match="prefix-stable"):
        tokenize_conversation(tokenizer, CONVERSATION[:2])


CONCAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""Messages' contents back to back: a tokenizer can merge characters across a turn boundary."""


def test_ids_that_differ_from_the_whole_conversation_s_are_refused_unless_ignored(tmp_path):
    """verl's check: 'h' + 'ello' tokenized turn by turn is not 'hello' tokenized whole (a BPE merge)."""
    tokenizer = build_local_tokenizer()
    tokenizer.chat_template = CONCAT_TEMPLATE
    chat = [{"role": "user", "content": "h"}, {"role": "assistant", "content": "ello"}]
    whole = tokenizer("hello", add_special_tokens=False)["input_ids"]
    ids, _ = tokenize_conversation(tokenizer, chat)
    assert ids != whole
    with pytest.raises(ValueError, match=r"differ from the whole conversation's tokenization at token 0"):
        tokenize_conversation(tokenizer, chat, whole_conversation_check=True)
    path = write(tmp_path / "chat.parquet", [{"messages": chat}])
    with pytest.raises(ValueError, match=r"chat.parquet: row 0: .*data.ignore_input_ids_mismatch=True"):
        SFTDataset(path, tokenizer, MULTITURN)
    ignored = SFTDataset(path, tokenizer, SFTDataConfig(multiturn=MultiturnConfig(enable=True),
                                                        ignore_input_ids_mismatch=True))
    assert ignored[0]["input_ids"].tolist() == ids
    fine = [{"role": "user", "content": "hel"}, {"role": "assistant", "content": "lo"}]  # 'hel' + 'lo' == 'hello'
    assert tokenize_conversation(tokenizer, fine, whole_conversation_check=True)[0] == whole


def test_a_row_s_enable_thinking_column_reaches_the_chat_template(tmp_path):
    """verl's data.multiturn.enable_thinking_key: per-row enable_thinking; a null row keeps the default."""
    tokenizer = build_local_tokenizer()
    tokenizer.chat_template = "{% if enable_thinking %}<think>{% endif %}" + CONCAT_TEMPLATE
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b"}]
    path = write(tmp_path / "chat.parquet", [{"messages": chat, "enable_thinking": flag} for flag in (True, False, None)])
    rows = [item["input_ids"].tolist() for item in SFTDataset(path, tokenizer, MULTITURN)]
    thinking = tokenizer("<think>", add_special_tokens=False)["input_ids"]
    assert rows[0][: len(thinking)] == thinking and rows[1] == rows[2] and rows[0][len(thinking):] == rows[1]
    on_by_default = SFTDataConfig(multiturn=MultiturnConfig(enable=True), apply_chat_template_kwargs={"enable_thinking": True})
    rows = [item["input_ids"].tolist() for item in SFTDataset(path, tokenizer, on_by_default)]
    assert rows[0] == rows[2] != rows[1]
