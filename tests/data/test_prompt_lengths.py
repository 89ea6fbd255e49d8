"""verl's data.filter_overlong_prompts_workers: prompt lengths measured over forked worker processes equal the
driver's own, in order."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

from hybridflow.data import prompt_lengths
from hybridflow.data.prompt_lengths import chat_prompt_lengths


def test_worker_processes_measure_the_same_lengths_in_order(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_lengths, "CHUNK", 3)  # 4 chunks of 10 prompts: several tasks per worker
    conversations = [[{"role": "user", "content": "word " * (3 * i + 1)}] for i in range(10)]
    alone = chat_prompt_lengths(smollm2_tokenizer, conversations, {}, workers=1)
    assert len(set(alone)) == 10 and alone == sorted(alone)  # each prompt longer than the one before
    pools = []

    class RecordedPool(ProcessPoolExecutor):
        def __init__(self, max_workers, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(prompt_lengths, "ProcessPoolExecutor", RecordedPool)
    assert chat_prompt_lengths(smollm2_tokenizer, conversations, {}, workers=8) == alone
    workers = min(8, os.cpu_count() or 1, 4)  # at most the CPUs here, and the chunks
    assert pools == ([workers] if workers > 1 else [])
    assert chat_prompt_lengths(smollm2_tokenizer, [], {}, workers=8) == []
