"""`GenerationServer.abort` (verl's over_sample_rate): queued and later requests are answered at once with no tokens,
a continuous-batching run ends the sequences it decodes with their tokens so far, and the next `start` serves again."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.server import ABORTED, GenerationServer
from tests.engines.rollout.test_server import GREEDY, ScriptedSource, _prompts, sharp_llama  # noqa: F401  (fixture)


class AbortingSource(ScriptedSource):
    """A scripted source whose abort is requested from the `abort_at`-th step on (the batcher asks once a step)."""

    def __init__(self, schedule, abort_at: int) -> None:
        super().__init__(schedule)
        self.abort_at, self.asked = abort_at, 0

    def abort_requested(self):
        self.asked += 1
        return self.asked >= self.abort_at


def test_batcher_abort_ends_decoding_sequences_with_their_tokens_so_far(sharp_llama, tiny_tokenizer):
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, GREEDY, max_num_seqs=4)
    prompts = _prompts(tiny_tokenizer)
    greedy = SamplingParams(max_new_tokens=40, do_sample=False)
    pad = tiny_tokenizer.pad_token_id

    def serve(source):  # no stop ids: every response runs to its budget unless aborted
        return rollout.batcher.serve(greedy, [], pad, 64, source)

    # "short" ends before the abort; "long" and "third" (from the 5th step) are decoding when it comes.
    requests = {"short": (prompts[0], 3), "long": (prompts[1], 30), "third": (prompts[3], 30)}
    schedule = {0: [("short", *requests["short"]), ("long", *requests["long"])], 4: [("third", *requests["third"])]}
    source = AbortingSource(schedule, abort_at=12)
    stats = serve(source)
    finished = {key: (tokens, log_probs, reason) for key, tokens, log_probs, reason in source.finished}
    assert set(finished) == set(requests)
    alone = {}
    for key, (prompt, budget) in requests.items():
        solo = ScriptedSource({0: [(key, prompt, budget)]})
        serve(solo)
        alone[key] = solo.finished[0]
    assert finished["short"][0] == alone["short"][1] and finished["short"][2] == "length"
    for key in ("long", "third"):
        tokens, log_probs, reason = finished[key]
        assert reason == ABORTED and 0 < len(tokens) < requests[key][1], key
        assert tokens == alone[key][1][: len(tokens)], key  # what it had decoded, as if alone
        torch.testing.assert_close(log_probs, alone[key][2][: len(tokens)], atol=1e-4, rtol=0)
    # 11 steps before the abort: "long" has its prefill's token and 11 more, "third" joined 4 steps later
    assert (len(finished["long"][0]), len(finished["third"][0])) == (12, 8), finished
    assert stats["num_decode_steps"] == 11  # the run ended at the abort, not at "long"'s 30th token


class GatedRollout:
    """An hf rollout whose first batch waits for `gate`: requests sent meanwhile stay queued in the server."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout
        self.entered, self.gate = threading.Event(), threading.Event()

    def generate_sequences(self, prompts):
        self.entered.set()
        assert self.gate.wait(30)
        return self.rollout.generate_sequences(prompts)


def test_abort_answers_queued_and_later_requests_and_start_serves_again(sharp_llama, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    rollout = GatedRollout(HFRollout(sharp_llama, tiny_tokenizer, GREEDY))
    server = GenerationServer(rollout, tiny_tokenizer.pad_token_id, batch_wait_s=0.01)
    server.start()
    try:
        running = server.submit("running", prompts[0], GREEDY)
        assert rollout.entered.wait(30)  # its batch runs (held at the gate)
        queued = [server.submit(f"queued{i}", p, GREEDY) for i, p in enumerate(prompts[1:3])]
        assert server.abort() == 2
        for future in queued:  # answered at once, while the running batch still waits at the gate
            assert future.result(timeout=5).token_ids == [] and future.result().finish_reason == ABORTED
        later = server.submit("later", prompts[3], GREEDY).result(timeout=5)
        assert (later.token_ids, later.finish_reason) == ([], ABORTED)
        assert not running.done()
        rollout.gate.set()
        kept = running.result(timeout=30)  # a batch that was running when the abort came runs to its end
        assert kept.finish_reason in ("stop", "length") and kept.token_ids
    finally:
        rollout.gate.set()
        server.stop()
    assert server.stats()["num_aborted"] == 3
    server.start()  # the next step serves again
    try:
        again = server.generate("again", prompts[0], GREEDY)
    finally:
        server.stop()
    assert again.token_ids == kept.token_ids


def test_abort_with_continuous_batching_ends_the_run(sharp_llama, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    server = GenerationServer(NativeRollout(sharp_llama, tiny_tokenizer, GREEDY), tiny_tokenizer.pad_token_id,
                              max_model_len=64)
    assert server.streaming
    server.start()
    try:
        before = server.generate("before", prompts[0], GREEDY)
        server.abort()
        after = server.generate("after", prompts[1], GREEDY)
        assert (after.token_ids, after.finish_reason) == ([], ABORTED)
    finally:
        server.stop()
    assert not server.running and server.stats()["num_aborted"] == 1
    server.start()
    try:
        assert server.generate("next step", prompts[0], GREEDY).token_ids == before.token_ids
    finally:
        server.stop()


def test_run_source_answers_its_waiting_requests_once_aborted():
    import concurrent.futures
    import queue
    from collections import deque

    from hybridflow.engines.rollout.server import _Request, _RunSource

    def request(name: str, temperature: float) -> _Request:
        return _Request(name, [1, 2], SamplingParams(max_new_tokens=4, temperature=temperature),
                        concurrent.futures.Future())

    requests: queue.Queue = queue.Queue()
    other, queued = request("other params", 0.5), request("queued", 1.0)
    requests.put(queued)
    requests.put(None)  # a stop asked for meanwhile is kept
    aborting = threading.Event()
    source = _RunSource(requests, deque([other]), SamplingParams(max_new_tokens=1), False, aborting)
    assert not source.abort_requested()
    aborting.set()
    assert source.abort_requested()
    assert source.take(4, block=False) == [] and source.take(4, block=True) is None
    for waiting in (other, queued):
        assert waiting.future.result(timeout=1).finish_reason == ABORTED
    assert source.stopping and source.num_aborted == 2 and not source.pending


@pytest.mark.parametrize("streaming", [False, True])
def test_a_stopped_server_counts_no_abort(sharp_llama, tiny_tokenizer, streaming):
    server = GenerationServer(NativeRollout(sharp_llama, tiny_tokenizer, GREEDY), tiny_tokenizer.pad_token_id,
                              max_model_len=64 if streaming else None)
    assert server.abort() == 0 and server.stats()["num_aborted"] == 0


def staggered_batch(backend, model, tokenizer):
    """The 5 test prompts and greedy sampling whose stop tokens, taken from `backend`'s own greedy responses, end
    the rows after 3, 6, 9, 13 and 24 tokens: stragglers for over-sampling to cut."""
    from hybridflow.engines.rollout.server import build_prompt_batch

    batch = build_prompt_batch(_prompts(tokenizer), tokenizer.pad_token_id)
    greedy = backend(model, tokenizer, SamplingParams(max_new_tokens=24, do_sample=False))
    tokens = greedy.generate_sequences(batch).batch["responses"].tolist()
    stops = [tokens[row][step] for row, step in enumerate((2, 5, 8, 12))]
    return batch, SamplingParams(max_new_tokens=24, do_sample=False, stop_token_ids=stops)


def test_batch_generation_over_samples_and_the_kept_rows_are_as_if_alone(sharp_llama, tiny_tokenizer):
    """mode=sync with the native engine: a training call ends once int(rows * (1 - rate)) rows have ended; the rest
    keep no tokens and are flagged; the kept rows are the uncut call's; validation never ends early."""
    batch, budgets = staggered_batch(NativeRollout, sharp_llama, tiny_tokenizer)
    plain = NativeRollout(sharp_llama, tiny_tokenizer, budgets)
    uncut = plain.generate_sequences(batch)
    lengths = uncut.batch["response_mask"].sum(-1)
    assert lengths.tolist() == [3, 6, 9, 13, 24], lengths
    rollout = NativeRollout(sharp_llama, tiny_tokenizer, budgets, over_sample_rate=0.4)  # int(5 * 0.6) = 3 rows
    out = rollout.generate_sequences(batch)
    aborted = torch.tensor(out.non_tensor_batch["__aborted__"].tolist())
    kept = ~aborted
    assert aborted.tolist() == [False, False, False, True, True]  # the three shortest ended first
    assert torch.equal(out.batch["responses"][kept], uncut.batch["responses"][kept])
    assert out.batch["response_mask"][aborted].sum() == 0
    assert (out.batch["responses"][aborted] == tiny_tokenizer.pad_token_id).all()
    assert rollout.last_stats["num_decode_steps"] < plain.last_stats["num_decode_steps"]
    assert rollout.last_stats["aborted_rows"] == int(aborted.sum())
    batch.meta_info["validate"] = True
    assert "__aborted__" not in rollout.generate_sequences(batch).non_tensor_batch

    # two slots for 5 prompts x 2 samples: prompts still waiting for a slot end too, with all their samples
    twice = dataclasses.replace(budgets, n=2)
    batch.meta_info["validate"] = False
    uncut = NativeRollout(sharp_llama, tiny_tokenizer, twice, max_num_seqs=2).generate_sequences(batch)
    small = NativeRollout(sharp_llama, tiny_tokenizer, twice, max_num_seqs=2, over_sample_rate=0.5)
    out = small.generate_sequences(batch)
    aborted = torch.tensor(out.non_tensor_batch["__aborted__"].tolist())
    assert int((~aborted).sum()) >= 5 and aborted.view(5, 2).all(1).any()  # a whole prompt never started
    assert torch.equal(out.batch["responses"][~aborted], uncut.batch["responses"][~aborted])
    assert small.last_stats["aborted_rows"] == int(aborted.sum())


def test_hf_batch_generation_over_samples_too(sharp_llama, tiny_tokenizer):
    """The hf engine's generate stops once int(rows * (1 - rate)) rows have ended; the kept rows are the uncut call's,
    the rest keep no tokens; validation never stops early."""
    batch, budgets = staggered_batch(HFRollout, sharp_llama, tiny_tokenizer)
    uncut = HFRollout(sharp_llama, tiny_tokenizer, budgets).generate_sequences(batch)
    assert uncut.batch["response_mask"].sum(-1).tolist() == [3, 6, 9, 13, 24]
    rollout = HFRollout(sharp_llama, tiny_tokenizer, budgets, over_sample_rate=0.4)
    out = rollout.generate_sequences(batch)
    aborted = torch.tensor(out.non_tensor_batch["__aborted__"].tolist())
    assert aborted.tolist() == [False, False, False, True, True]
    assert torch.equal(out.batch["responses"][~aborted], uncut.batch["responses"][~aborted])
    assert out.batch["response_mask"][aborted].sum() == 0
    assert (out.batch["responses"][aborted] == tiny_tokenizer.pad_token_id).all()
    batch.meta_info["validate"] = True
    assert "__aborted__" not in rollout.generate_sequences(batch).non_tensor_batch
