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
