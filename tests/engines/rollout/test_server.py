"""The token-in-token-out generation server: concurrent requests are batched, each answered as if alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.server import GenerationServer, TokenOutput, build_prompt_batch, split_token_outputs
from hybridflow.models import build_tiny_model

GREEDY = SamplingParams(max_new_tokens=6, do_sample=False)


@pytest.fixture(scope="module")
def sharp_llama(tiny_tokenizer):
    model, _ = build_tiny_model("llama", initializer_range=0.3, seed=1, tokenizer=tiny_tokenizer)
    return model.eval()


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["hello there", "what is 12 + 7? The answer is", "x", "def add(a, b):", "one two three four five"]
    return [tokenizer(text)["input_ids"] for text in texts]


def test_prompt_batch_is_left_padded_with_verl_positions():
    batch = build_prompt_batch([[5, 6, 7], [9]], pad_token_id=0)
    assert batch.batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert batch.batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    with pytest.raises(ValueError, match="empty prompt"):
        build_prompt_batch([[1], []], pad_token_id=0)


@pytest.mark.parametrize("backend", [HFRollout, NativeRollout])
def test_concurrent_requests_are_batched_and_equal_single_runs(backend, sharp_llama, tiny_tokenizer):
    rollout = backend(sharp_llama, tiny_tokenizer, SamplingParams(max_new_tokens=6))
    prompts = _prompts(tiny_tokenizer)
    server = GenerationServer(rollout, tiny_tokenizer.pad_token_id, batch_wait_s=0.2)
    server.start()
    try:
        alone = [server.generate(f"solo{i}", p, GREEDY) for i, p in enumerate(prompts)]
        assert server.stats()["num_batches"] == len(prompts)
        results: dict[int, TokenOutput] = {}

        def ask(i: int) -> None:
            results[i] = server.generate(f"req{i}", prompts[i], GREEDY)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    assert server.stats()["num_batches"] < 2 * len(prompts)  # the concurrent ones shared batches
    for i, single in enumerate(alone):
        assert results[i].token_ids == single.token_ids, i
        torch.testing.assert_close(results[i].log_probs, single.log_probs, atol=1e-4, rtol=0)
        assert len(single.token_ids) == len(single.log_probs) <= 6
        assert single.finish_reason == ("length" if len(single.token_ids) == 6 else "stop")


def test_async_requests_with_different_params_and_stop_tokens(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, SamplingParams(max_new_tokens=6))
    prompt = _prompts(tiny_tokenizer)[1]
    server = GenerationServer(rollout, tiny_tokenizer.pad_token_id, batch_wait_s=0.05)
    server.start()

    async def both() -> list[TokenOutput]:
        free = await server.generate_async("a", prompt, GREEDY)
        stop = free.token_ids[2]
        stopped = SamplingParams(max_new_tokens=6, do_sample=False, stop_token_ids=(stop,))
        sampled = SamplingParams(max_new_tokens=3, temperature=0.9)
        return [free, *await asyncio.gather(server.generate_async("b", prompt, stopped),
                                             server.generate_async("c", prompt, sampled))]

    try:
        free, stopped, sampled = asyncio.run(both())
    finally:
        server.stop()
    first_stop = free.token_ids.index(free.token_ids[2]) + 1
    assert stopped.token_ids == free.token_ids[:first_stop] and stopped.finish_reason == "stop"
    assert len(sampled.token_ids) <= 3


def test_errors_reach_the_caller_and_misuse_is_refused(sharp_llama, tiny_tokenizer):
    server = GenerationServer(NativeRollout(sharp_llama, tiny_tokenizer, GREEDY), tiny_tokenizer.pad_token_id)
    with pytest.raises(RuntimeError, match="not running"):
        server.generate("a", [1, 2], GREEDY)
    server.start()
    try:
        with pytest.raises(ValueError, match="n must be 1"):
            server.generate("a", [1, 2], SamplingParams(n=2))
        with pytest.raises(ValueError, match="empty prompt"):
            server.generate("a", [], GREEDY)
        huge = SamplingParams(max_new_tokens=4, do_sample=False)
        with pytest.raises(IndexError):  # a token id outside the vocabulary fails in the engine thread
            server.generate("bad", [10**7], huge)
        assert server.generate("after", [5, 6], huge).token_ids  # the server keeps serving
    finally:
        server.stop()
    assert not server.running


def test_split_token_outputs_reads_the_response_mask():
    from hybridflow.protocol import DataProto

    output = DataProto.from_dict(tensors={
        "responses": torch.tensor([[4, 5, 2, 0], [7, 8, 9, 10]]),
        "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        "rollout_log_probs": torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.1, -0.2, -0.3, -0.4]]),
    })
    first, second = split_token_outputs(output, max_new_tokens=4)
    assert first == TokenOutput([4, 5, 2], [-0.5, -1.0, -2.0], "stop")
    assert second.token_ids == [7, 8, 9, 10] and second.finish_reason == "length"



def test_requests_with_different_budgets_share_a_batch(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, SamplingParams(max_new_tokens=6))
    prompts = _prompts(tiny_tokenizer)
    budgets = [2, 6, 4, 6, 3]
    server = GenerationServer(rollout, tiny_tokenizer.pad_token_id, batch_wait_s=0.2)
    server.start()
    try:
        alone = [server.generate(f"s{i}", p, SamplingParams(max_new_tokens=b, do_sample=False))
                 for i, (p, b) in enumerate(zip(prompts, budgets))]
        before = server.stats()["num_batches"]

        async def together() -> list[TokenOutput]:
            return await asyncio.gather(*(
                server.generate_async(f"t{i}", p, SamplingParams(max_new_tokens=b, do_sample=False))
                for i, (p, b) in enumerate(zip(prompts, budgets))
            ))

        joint = asyncio.run(together())
    finally:
        server.stop()
    assert server.stats()["num_batches"] - before == 1  # one batch despite five different budgets
    for single, shared, budget in zip(alone, joint, budgets):
        assert shared.token_ids == single.token_ids and len(shared.token_ids) <= budget
        assert shared.finish_reason == single.finish_reason


# ------------------------------------------------------------------ continuous batching (streaming backends)
class ScriptedSource:
    """A RequestSource that hands out requests at chosen decode steps and records the finishing order."""

    def __init__(self, schedule: dict[int, list[tuple[str, list[int], int]]]) -> None:
        self.schedule = schedule  # call number -> requests handed out on that call
        self.calls = 0
        self.finished: list[tuple[str, list[int], list[float], str]] = []

    def take(self, limit, block):
        batch = self.schedule.pop(self.calls, [])
        self.calls += 1
        if not batch and block and not self.schedule:
            return None
        assert len(batch) <= limit
        return batch

    def finish(self, key, token_ids, log_probs, finish_reason):
        self.finished.append((key, token_ids, log_probs, finish_reason))

    def abort_requested(self):
        return False


def test_streaming_batcher_admits_requests_into_a_running_decode(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, GREEDY, max_num_seqs=4)
    prompts = _prompts(tiny_tokenizer)
    greedy = SamplingParams(max_new_tokens=40, do_sample=False)
    pad = tiny_tokenizer.pad_token_id

    def serve(source):  # no stop ids: every response runs to its budget
        return rollout.batcher.serve(greedy, [], pad, 64, source)

    # "long" starts alone; "short" arrives at the 6th step and finishes while "long" still decodes; "late"
    # arrives after "short" is done and reuses its row and slot.
    requests = {"long": (prompts[1], 30), "short": (prompts[0], 3), "late": (prompts[3], 4)}
    source = ScriptedSource({0: [("long", *requests["long"])], 5: [("short", *requests["short"])],
                             12: [("late", *requests["late"])]})
    stats = serve(source)
    alone = {}
    for key, (prompt, budget) in requests.items():
        solo = ScriptedSource({0: [(key, prompt, budget)]})
        serve(solo)
        alone[key] = solo.finished[0]
    assert [key for key, *_ in source.finished] == ["short", "late", "long"]
    for key, token_ids, log_probs, reason in source.finished:
        assert token_ids == alone[key][1] and reason == "length", key  # as if decoded alone
        torch.testing.assert_close(log_probs, alone[key][2], atol=1e-4, rtol=0)
    lengths = {key: len(token_ids) for key, token_ids, *_ in source.finished}
    assert lengths == {"long": 30, "short": 3, "late": 4}
    assert stats["num_decode_steps"] == 29  # one run: the first token of each comes from its prefill
    assert stats["decoded_rows"] == 29 + 2 + 3  # steps where "short" and "late" decoded beside "long"


def test_streaming_server_equals_single_runs(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, GREEDY)
    prompts = _prompts(tiny_tokenizer)
    budgets = [2, 6, 4, 6, 3]
    server = GenerationServer(rollout, tiny_tokenizer.pad_token_id, max_model_len=64)
    assert server.streaming
    server.start()
    try:
        alone = [server.generate(f"s{i}", p, SamplingParams(max_new_tokens=b, do_sample=False))
                 for i, (p, b) in enumerate(zip(prompts, budgets))]
        sampled = SamplingParams(max_new_tokens=3, temperature=0.9)

        async def together() -> list[TokenOutput]:
            greedy = [server.generate_async(f"t{i}", p, SamplingParams(max_new_tokens=b, do_sample=False))
                      for i, (p, b) in enumerate(zip(prompts, budgets))]
            return await asyncio.gather(*greedy, server.generate_async("other params", prompts[0], sampled))

        *joint, other = asyncio.run(together())
        with pytest.raises(ValueError, match="max_model_len"):
            server.generate("too long", list(range(3, 63)), SamplingParams(max_new_tokens=5))
        with pytest.raises(IndexError):  # a token id outside the vocabulary fails the run, not the server
            server.generate("bad", [10**7], GREEDY)
        assert server.generate("after", prompts[0], GREEDY).token_ids == server.generate("again", prompts[0], GREEDY).token_ids
    finally:
        server.stop()
    assert not server.running
    for single, shared, budget in zip(alone, joint, budgets):
        assert shared.token_ids == single.token_ids and len(shared.token_ids) <= budget
        assert shared.finish_reason == single.finish_reason
        torch.testing.assert_close(shared.log_probs, single.log_probs, atol=1e-4, rtol=0)
    assert 1 <= len(other.token_ids) <= 3
    stats = server.stats()
    assert stats["num_requests"] == 2 * len(prompts) + 1 + 2 and stats["mean_batch_size"] > 1


def test_streaming_needs_a_streaming_backend_and_a_length(sharp_llama, tiny_tokenizer):
    assert not GenerationServer(HFRollout(sharp_llama, tiny_tokenizer, GREEDY), 0, max_model_len=64).streaming
    assert not GenerationServer(NativeRollout(sharp_llama, tiny_tokenizer, GREEDY), 0).streaming
    with pytest.raises(ValueError, match="max_model_len"):
        GenerationServer(NativeRollout(sharp_llama, tiny_tokenizer, GREEDY), 0, max_model_len=1)


def test_next_turn_reuses_the_previous_turns_cache(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, GREEDY)
    greedy = SamplingParams(max_new_tokens=12, do_sample=False)
    first_prompt = _prompts(tiny_tokenizer)[1] + _prompts(tiny_tokenizer)[4]  # >= 8 tokens: worth reusing
    pad = tiny_tokenizer.pad_token_id

    def serve(requests):
        source = ScriptedSource({i: [request] for i, request in enumerate(requests)})
        stats = rollout.batcher.serve(greedy, [], pad, 96, source)
        return {key: (ids, lps) for key, ids, lps, _ in source.finished}, stats

    # Turn 1, then turn 2 = turn 1's prompt + response + new "tool" tokens, in one run (the cache is reused)...
    turn1, _ = serve([("t1", first_prompt, 12)])
    second_prompt = first_prompt + turn1["t1"][0] + [7, 8, 9]
    both = ScriptedSource({0: [("t1", first_prompt, 12)]})
    calls = iter(range(1000))

    def take(limit, block):  # turn 2 arrives once turn 1 has finished
        call = next(calls)
        if call == 0:
            return [("t1", first_prompt, 12)]
        if both.finished and not any(key == "t2" for key, *_ in both.finished) and call < 100:
            if not getattr(take, "sent", False):
                take.sent = True
                return [("t2", second_prompt, 12)]
        return None if block else []

    both.take = take
    stats = rollout.batcher.serve(greedy, [], pad, 96, both)
    reused = {key: (ids, lps) for key, ids, lps, _ in both.finished}
    # ... equals turn 2 prefilled from scratch in a fresh run.
    fresh, fresh_stats = serve([("t2", second_prompt, 12)])
    assert stats["prefix_hits"] == 1 and fresh_stats["prefix_hits"] == 0
    assert stats["reused_tokens"] == len(first_prompt) + 12 - 1  # all but turn 1's last token (never fed)
    assert reused["t2"][0] == fresh["t2"][0]
    torch.testing.assert_close(reused["t2"][1], fresh["t2"][1], atol=1e-4, rtol=0)
    assert reused["t1"][0] == turn1["t1"][0]


def test_prefix_reuse_through_the_server(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, GREEDY)
    greedy = SamplingParams(max_new_tokens=8, do_sample=False)
    server = GenerationServer(rollout, tiny_tokenizer.pad_token_id, max_model_len=128)
    server.start()
    try:
        prompts = [p + _prompts(tiny_tokenizer)[4] for p in _prompts(tiny_tokenizer)]
        turns = [server.generate(f"a{i}", p, greedy) for i, p in enumerate(prompts)]
        follow = [p + t.token_ids + [5, 6] for p, t in zip(prompts, turns)]
        continued = [server.generate(f"b{i}", p, greedy) for i, p in enumerate(follow)]
    finally:
        server.stop()
    stats = server.stats()
    assert stats["prefix_reuse"] > 0.3  # the second turns reused their first turns' caches
    fresh = NativeRollout(sharp_llama, tiny_tokenizer, GREEDY)
    fresh_server = GenerationServer(fresh, tiny_tokenizer.pad_token_id)  # per-batch mode: no reuse
    fresh_server.start()
    try:
        expected = [fresh_server.generate(f"c{i}", p, greedy) for i, p in enumerate(follow)]
    finally:
        fresh_server.stop()
    for got, want in zip(continued, expected):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-4, rtol=0)
