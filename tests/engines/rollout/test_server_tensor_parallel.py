"""The generation server of a tensor-parallel replica on 2 gloo ranks (rollout.mode=async with
tensor_model_parallel_size=2): the leader takes the requests and drives its follower step by step (per-batch mode
with the hf engine, continuous batching with the native engine); its answers equal one rank's server, and the
follower refuses requests; an idle leader's keep-alives keep the follower in step."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.server import GenerationServer
from hybridflow.models import build_causal_lm, build_tiny_model, load_tokenizer
from hybridflow.models.loader import save_model_and_tokenizer
from tests.engines.helpers import run_distributed
from tests.engines.rollout.native.test_tensor_parallel import _rollout_tp_mesh

TEXTS = ["hello there", "what is 12 + 7? The answer is", "x", "def add(a, b):", "one two three four five"]
BUDGETS = [6, 2, 5, 6, 3]


def _answers(server: GenerationServer, prompts: list[list[int]]) -> list:
    """Greedy requests with different budgets, sent together, and one sampled request."""

    async def together():
        greedy = [server.generate_async(f"g{i}", p, SamplingParams(max_new_tokens=b, do_sample=False))
                  for i, (p, b) in enumerate(zip(prompts, BUDGETS))]
        return await asyncio.gather(*greedy)

    answers = asyncio.run(together())
    time.sleep(0.3)  # idle: the leader sends keep-alives (KEEPALIVE_S is cut to 0.05 s in the test)
    torch.manual_seed(3)
    answers.append(server.generate("s", prompts[0], SamplingParams(max_new_tokens=4, temperature=0.8)))
    return answers


def _serve_tp(rank: int, world_size: int, model_dir: str) -> None:
    from hybridflow.engines.rollout import server as server_module

    server_module.KEEPALIVE_S = 0.05
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    mesh = _rollout_tp_mesh(world_size)
    for engine, max_model_len in ((HFRollout, None), (functools.partial(NativeRollout, kernels="torch"), 64)):
        params = SamplingParams(max_new_tokens=6)
        single = GenerationServer(engine(build_causal_lm(model_dir), tokenizer, params), tokenizer.pad_token_id,
                                  max_model_len=max_model_len)
        single.start()
        try:
            expected = _answers(single, prompts)
        finally:
            single.stop()
        server = GenerationServer(engine(model_dir, tokenizer, params, tp_mesh=mesh), tokenizer.pad_token_id,
                                  max_model_len=max_model_len)
        assert server.streaming == (max_model_len is not None)
        torch.manual_seed(11)  # the worker seeds a replica's peers alike
        server.start()
        try:
            if rank == 0:
                answers = _answers(server, prompts)
            else:
                with pytest.raises(RuntimeError, match="follows its leader"):
                    server.generate("x", prompts[0], SamplingParams(max_new_tokens=2))
        finally:
            server.stop()
        assert not server.running
        if rank == 0:
            assert server.keepalives > 0  # the pause before the sampled request
            assert len({len(a.token_ids) for a in answers}) > 1  # the budgets cut the responses differently
            for got, want in zip(answers[:-1], expected[:-1], strict=True):
                assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, max_model_len
                torch.testing.assert_close(got.log_probs, want.log_probs, atol=1e-4, rtol=0)
            assert 1 <= len(answers[-1].token_ids) <= 4


def test_a_tensor_parallel_replica_serves_from_its_leader(tmp_path, tiny_tokenizer):
    model, tokenizer = build_tiny_model("llama", initializer_range=0.3, seed=1, tokenizer=tiny_tokenizer)
    run_distributed(_serve_tp, 2, str(save_model_and_tokenizer(model, tokenizer, tmp_path / "llama")))
