"""Over-sampling (rollout.over_sample_rate): once int(N * (1 - rate)) loops have returned, the replicas abort the
rest; aborted rows keep their prompt with an empty, untrained response, are flagged and counted; validation never
aborts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from hybridflow.agents.manager import AgentLoopManager
from hybridflow.engines.rollout.base import completions_needed
from hybridflow.engines.rollout.config import MultiTurnConfig, RolloutConfig
from hybridflow.engines.rollout.server import ABORTED, TokenOutput
from hybridflow.protocol import DataProto
from hybridflow.tools.calculator import CalculatorTool
from hybridflow.utils.config import ConfigFieldError
from tests.agents.scripted_server import QUESTION, call
from tests.agents.test_agent_loops import FakeWorkerGroup


class StragglerServer:
    """Answers each request with the next of `lengths` tokens; requests whose length is None wait until `abort`
    (or `patience_s`, then answer 6 tokens) - the step's stragglers."""

    def __init__(self, tokenizer, lengths: list[int | None], patience_s: float = 30.0, text: str = "12") -> None:
        self.tokenizer, self.lengths, self.patience_s = tokenizer, list(lengths), patience_s
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.partial_ids = self.ids[:1]
        """What an aborted request had decoded by the abort."""
        self.aborted: asyncio.Event | None = None
        self.abort_calls = 0

    async def __call__(self, request_id, prompt_ids, params) -> TokenOutput:
        self.aborted = self.aborted or asyncio.Event()
        length = self.lengths.pop(0) if self.lengths else 1
        if length is None:
            try:
                await asyncio.wait_for(self.aborted.wait(), self.patience_s)
                return TokenOutput(self.partial_ids, [-0.1] * len(self.partial_ids), ABORTED)
            except asyncio.TimeoutError:
                length = 6
        ids = (self.ids * length)[:length] + [self.tokenizer.eos_token_id]
        return TokenOutput(ids, [-0.5] * len(ids), "stop")

    async def abort(self) -> int:
        self.abort_calls += 1
        self.aborted.set()
        return 0


def rows(n: int) -> DataProto:
    raw = np.empty(n, dtype=object)
    for i in range(n):
        raw[i] = list(QUESTION)
    return DataProto.from_dict(tensors={"index": torch.arange(n)}, non_tensors={"raw_prompt": raw})


def test_completions_needed_follows_verl():
    assert completions_needed(10, 0.0) == 10
    assert completions_needed(10, 0.1) == 9
    assert completions_needed(8, 0.25) == 6
    assert completions_needed(3, 0.1) == 2  # int(2.7)
    assert completions_needed(1, 0.5) == 1  # never zero


def test_the_stragglers_are_aborted_and_emptied(chat_tokenizer):
    # 8 loops, rate 0.25: after 6 have returned, the 2 stragglers are aborted
    server = StragglerServer(chat_tokenizer, [2, None, 3, 2, None, 4, 2, 1])
    rollout = RolloutConfig(mode="async", over_sample_rate=0.25)
    manager = AgentLoopManager(FakeWorkerGroup(server), rollout, chat_tokenizer, response_length=16)
    out = manager.generate_sequences(rows(8))
    flags = out.non_tensor_batch["__aborted__"]
    assert flags.tolist() == [False, True, False, False, True, False, False, False]
    aborted = torch.tensor(flags.tolist())
    assert server.abort_calls == 1
    mask = out.batch["response_mask"]
    assert mask[aborted].sum() == 0 and (mask[~aborted].sum(-1) > 0).all()  # nothing of theirs is trained
    assert (out.batch["responses"][aborted] == chat_tokenizer.pad_token_id).all()
    assert torch.equal(out.batch["prompts"][1], out.batch["prompts"][0])  # the prompt stays: the row is scored


def test_validation_and_rate_zero_wait_for_every_loop(chat_tokenizer):
    for rollout, validate in ((RolloutConfig(mode="async", over_sample_rate=0.5), True),
                              (RolloutConfig(mode="async"), False)):
        server = StragglerServer(chat_tokenizer, [1, None, 1, 1], patience_s=0.2)
        manager = AgentLoopManager(FakeWorkerGroup(server), rollout, chat_tokenizer, response_length=16)
        prompts = rows(4)
        prompts.meta_info["validate"] = validate
        out = manager.generate_sequences(prompts)
        assert not out.non_tensor_batch["__aborted__"].any() and server.abort_calls == 0
        assert out.batch["response_mask"][1].sum() == 7  # the straggler ran to its end: 6 tokens and eos


def test_the_tool_agent_ends_at_an_aborted_turn(chat_tokenizer):
    """An aborted turn ends a multi-turn loop: no tool runs on it and no further turn is asked."""
    asked: list[str] = []

    class ToolServer(StragglerServer):
        async def __call__(self, request_id, prompt_ids, params):
            asked.append(request_id)
            if len(asked) <= 3:  # the first turn of each of three loops calls the calculator
                ids = self.tokenizer(call("calculator", expression="2+3"), add_special_tokens=False)["input_ids"]
                return TokenOutput(ids, [-0.5] * len(ids), "stop")
            return await super().__call__(request_id, prompt_ids, params)

    server = ToolServer(chat_tokenizer, [1, 1, None])  # the third loop's second turn straggles
    # it had decoded a whole tool call by the abort: without the loop's check the tool would run, and a turn follow
    server.partial_ids = chat_tokenizer(call("calculator", expression="1+1"), add_special_tokens=False)["input_ids"]
    rollout = RolloutConfig(mode="async", over_sample_rate=0.34, multi_turn=MultiTurnConfig(enable=True))
    manager = AgentLoopManager(FakeWorkerGroup(server), rollout, chat_tokenizer, response_length=200,
                               tools={"calculator": CalculatorTool()})
    out = manager.generate_sequences(rows(3))
    assert out.non_tensor_batch["__aborted__"].tolist() == [False, False, True]
    assert len(asked) == 6  # 3 first turns + 3 second turns, and no turn after the aborted one


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"over_sample_rate": 0.1, "name": "vllm"}, "use name in ['hf', 'native'], or mode=async"),
        ({"over_sample_rate": 1.0, "mode": "async"}, "must be in [0.0, 1.0)"),
        ({"over_sample_rate": -0.1, "mode": "async"}, "must be in [0.0, 1.0)"),
        ({"over_sample_rate": 0.1, "mode": "async", "name": "native", "tensor_model_parallel_size": 2},
         "tensor_model_parallel_size=1"),
    ],
)
def test_settings_it_cannot_honour_are_refused(overrides, words):
    with pytest.raises(ConfigFieldError, match="over_sample_rate") as info:
        RolloutConfig(**overrides)
    assert words in str(info.value)


def test_the_layouts_that_over_sample():
    """Per-batch servers abort queued requests on their leader alone (an hf replica split over ranks may); batch
    generation (native, hf) ends early on every rank of a tensor-parallel group alike (its steps are the same)."""
    assert RolloutConfig(mode="async", over_sample_rate=0.1, tensor_model_parallel_size=2).over_sample_rate == 0.1
    for name in ("native", "hf"):
        for tp in (1, 2):
            config = RolloutConfig(name=name, over_sample_rate=0.1, tensor_model_parallel_size=tp)
            assert config.over_sample_rate == 0.1


def test_a_loop_that_ignores_the_abort_fails_naming_the_fix(chat_tokenizer, monkeypatch):
    """A custom loop that never checks finish_reason would spin on the step's empty answers: it fails instead."""
    import dataclasses

    from hybridflow.agents.base import AGENT_LOOPS, AgentLoopBase, AgentLoopOutput

    class Stubborn(AgentLoopBase):
        async def run(self, messages, sampling_params, **kwargs):
            params = dataclasses.replace(sampling_params, max_new_tokens=4)
            while True:  # never looks at finish_reason
                turn = await self.context.server.generate(kwargs["request_id"], [1, 2, 3], params)
                if turn.token_ids:
                    return AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=turn.token_ids,
                                           response_mask=[1] * len(turn.token_ids), response_logprobs=turn.log_probs)

    class AbortedAfterAbort(StragglerServer):
        async def __call__(self, request_id, prompt_ids, params):
            if self.aborted is not None and self.aborted.is_set():
                return TokenOutput([], [], ABORTED)  # as the server answers every request after its abort
            return await super().__call__(request_id, prompt_ids, params)

    monkeypatch.setitem(AGENT_LOOPS._entries, "stubborn_test_loop", Stubborn)
    server = AbortedAfterAbort(chat_tokenizer, [2, None])
    server.partial_ids = []  # the straggler had decoded nothing by the abort
    rollout = RolloutConfig(mode="async", over_sample_rate=0.5)
    manager = AgentLoopManager(FakeWorkerGroup(server), rollout, chat_tokenizer, response_length=16)
    prompts = rows(2)
    prompts.non_tensor_batch["agent_name"] = np.array(["stubborn_test_loop"] * 2, dtype=object)
    with pytest.raises(RuntimeError, match="must return once a turn's finish_reason is 'abort'"):
        manager.generate_sequences(prompts)
