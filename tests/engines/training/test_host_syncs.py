"""The training hot path does not wait on the device inside the micro-batch loop (issue 25).

A real PPO update (policy loss, entropy bonus, KL loss) and a log-prob pass run on a tiny model on CPU while every
call that would block the host on an accelerator is counted: reading a tensor's value (`item`, `tolist`,
`__bool__`, `__float__`, `__int__`, `__index__`, `cpu`, `numpy`), and ops whose output size depends on tensor
values (`nonzero`, `unique`, `masked_select`, boolean-mask indexing). Calls made from the engine, loss and update
code and from transformers (the model's forward and its attention-mask building) count; torch's own do not. The
counts are a fixed small number per mini-batch: the same with 2 and with 6 micro-batches. Watching transformers is
what sees its mask building read the padding mask and position ids (found on the H200 by CUDA's sync error mode).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import transformers

import hybridflow
from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models.config import ModelConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.config import ActorConfig
from hybridflow.workers.ppo_update import make_actor_loss_fn, run_update
from tests.engines.helpers import make_batch
from tests.engines.sync_counter import SyncCounter

ROOT = Path(hybridflow.__file__).parent
WATCHED = (
    *(str(ROOT / part) for part in ("engines/training/", "engines/logprob.py", "algorithms/", "workers/ppo_update.py")),
    str(Path(transformers.__file__).parent),  # the model's forward: its attention-mask building once read the mask
)
ROWS = 12  # one mini-batch: 3 prompts x 4 samples
# Per pass, whatever the number of micro-batches: the update reads the mini-batch's global token/sequence counts
# (4), one host copy of the masks to plan every micro-batch's layout (2), the grad norm (1) and the metrics (2);
# the log-prob pass the host copy (2) and its results (2).
MAX_UPDATE_SYNCS, MAX_LOG_PROB_SYNCS = 9, 4
SYNC_REPORT = "called a synchronizing CUDA operation"
"""What `set_sync_debug_mode("warn")` says of each synchronising call. Its once-per-process notice ("Synchronization
debug mode is a prototype feature and does not yet detect all synchronizing operations") is not one: counted, it
made the first engine's update look one sync dearer on the H200 (2026-11-28)."""


def count_sync_reports(caught: list[warnings.WarningMessage]) -> int:
    return sum(SYNC_REPORT in str(w.message) for w in caught)


def _grouped_batch(vocab_size: int) -> DataProto:
    """3 prompts x 4 samples with PPO's inputs: old and reference log-probs, advantages."""
    data = make_batch(vocab_size, batch_size=ROWS, prompt_len=6, response_len=5, seed=4)
    tensors = dict(data.batch.items())
    for key in ("input_ids", "attention_mask", "position_ids"):
        tensors[key] = tensors[key].clone()
        for group in range(3):  # each group's rows share the first row's prompt
            tensors[key][group * 4 : group * 4 + 4, :6] = tensors[key][group * 4, :6]
    mask = tensors["attention_mask"]
    tensors["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    tensors["responses"] = tensors["input_ids"][:, 6:]
    gen = torch.Generator().manual_seed(5)
    tensors["old_log_probs"] = -torch.rand(ROWS, 5, generator=gen) - 9.0
    tensors["ref_log_prob"] = -torch.rand(ROWS, 5, generator=gen) - 9.0
    tensors["advantages"] = torch.randn(ROWS, 5, generator=gen)
    return DataProto.from_dict(tensors=tensors)


LAYOUTS = {
    "padded": FSDPEngineConfig(optim=OptimConfig(lr=1e-3)),
    "packed_fused_head": FSDPEngineConfig(
        model=ModelConfig(use_remove_padding=True, use_fused_kernels=True), optim=OptimConfig(lr=1e-3)
    ),
    "shared_prompts": FSDPEngineConfig(share_prompts=True, optim=OptimConfig(lr=1e-3)),
}


def _update(engine, data: DataProto, micro_batch_size: int) -> dict[str, list[float]]:
    """One real PPO update (policy loss, entropy bonus, KL loss) of the mini-batch `data`."""
    actor = ActorConfig(
        ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=micro_batch_size, entropy_coeff=0.01,
        use_kl_loss=True,
    )
    return run_update(
        engine, data, mini_batch_size_per_rank=ROWS, micro_batch_size=micro_batch_size, epochs=1, shuffle=False,
        seed=0, make_loss_fn=lambda counts: make_actor_loss_fn(actor, counts), calculate_entropy=True,
        metric_prefix="actor",
    )


def _log_prob(engine, data: DataProto, micro_batch_size: int) -> None:
    engine.compute_log_prob(data, calculate_entropy=True, micro_batch_size=micro_batch_size)


def _counted_passes(engine, data: DataProto, micro_batch_size: int, counter: SyncCounter) -> tuple[Counter, Counter]:
    counter.calls.clear()
    counter.active = True
    try:
        metrics = _update(engine, data, micro_batch_size)
        update = Counter(counter.calls)
        counter.calls.clear()
        _log_prob(engine, data, micro_batch_size)
        log_prob = Counter(counter.calls)
    finally:
        counter.active = False
    assert {"actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"} <= set(metrics)
    assert all(isinstance(values[0], float) for values in metrics.values())
    return update, log_prob


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_micro_batch_loop_does_not_wait_on_the_device(tiny_llama_dir, tiny_tokenizer, monkeypatch, layout):
    data = _grouped_batch(len(tiny_tokenizer))
    counter = SyncCounter(monkeypatch, WATCHED)
    counts = {}
    for micro_batch_size in (6, 2):  # 2 and 6 micro-batches
        engine = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(LAYOUTS[layout], micro_batch_size_per_gpu=2))
        before = [p.detach().clone() for p in engine.module.parameters()]
        counts[micro_batch_size] = _counted_passes(engine, data, micro_batch_size, counter)
        assert any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))  # a real step
    (update_2, log_prob_2), (update_6, log_prob_6) = counts[6], counts[2]
    assert update_2 == update_6, f"per-micro-batch syncs in the update: {update_6 - update_2}"
    assert log_prob_2 == log_prob_6, f"per-micro-batch syncs in the log-prob pass: {log_prob_6 - log_prob_2}"
    assert 0 < sum(update_2.values()) <= MAX_UPDATE_SYNCS, update_2  # (0: the counter saw nothing)
    assert 0 < sum(log_prob_2.values()) <= MAX_LOG_PROB_SYNCS, log_prob_2


def test_the_counter_sees_each_kind_of_blocking_call(monkeypatch):
    counter = SyncCounter(monkeypatch, (__file__,))
    values = torch.arange(6.0)
    counter.active = True
    try:
        values[values > 2]  # boolean gather
        values[values > 4] = 0.0  # boolean scatter
        values.sum().item()
        values[torch.tensor([0, 1])]  # integer index: no sync
    finally:
        counter.active = False
    values[values > 2]  # not counted once inactive
    kinds = sorted(label.split(" at ")[0] for label in counter.calls.elements())
    assert kinds == ["Tensor.__getitem__[bool]", "Tensor.__setitem__[bool]", "Tensor.item"]
    assert torch.tensor([torch.tensor(1), torch.tensor(2)]).tolist() == [1, 2]  # no sequence slot left behind


def test_only_the_detectors_reports_count_as_syncs():
    def caught(*texts):
        return [warnings.WarningMessage(text, UserWarning, __file__, 0) for text in texts]

    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    report = f"{SYNC_REPORT} (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.h:150.)"
    assert count_sync_reports(caught(notice, report, report)) == 2
    assert count_sync_reports(caught(notice)) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_sync_detector_sees_no_per_micro_batch_sync(tiny_llama_dir, tiny_tokenizer, layout):
    """CUDA's own detector (`set_sync_debug_mode("warn")`) during a real update and log-prob pass on the GPU: the
    synchronising calls are as many with 6 micro-batches as with 2, and no more than the CPU count's bounds."""
    data = _grouped_batch(len(tiny_tokenizer))
    counts = {}
    for micro_batch_size in (6, 2):
        engine = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(LAYOUTS[layout], micro_batch_size_per_gpu=2))
        assert engine.device.type == "cuda"
        _update(engine, data, micro_batch_size)  # warm-up: lazy CUDA init, allocator, optimizer state
        passes = {}
        for name, run_pass in (("update", _update), ("log_prob", _log_prob)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # every call, not once per call site
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run_pass(engine, data, micro_batch_size)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            passes[name] = count_sync_reports(caught)
        counts[micro_batch_size] = passes
    assert counts[6] == counts[2], f"syncs with 2 micro-batches {counts[6]}, with 6 {counts[2]}"
    assert counts[6]["update"] <= MAX_UPDATE_SYNCS and counts[6]["log_prob"] <= MAX_LOG_PROB_SYNCS, counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_micro_batch_loop_runs_under_cuda_sync_error_mode(tiny_llama_dir, tiny_tokenizer, monkeypatch, layout):
    """On CUDA, torch's own detector: `set_sync_debug_mode("error")` raises on any synchronising call. It is on from
    the first micro-batch's forward until the optimizer step (every forward, loss and backward of the loop), and
    around each forward of the log-prob pass; the mini-batch's own reads (counts before, grad norm and metrics
    after) stay outside, as on CPU."""
    data = _grouped_batch(len(tiny_tokenizer))
    engine = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(LAYOUTS[layout], micro_batch_size_per_gpu=2))
    assert engine.device.type == "cuda"
    _update(engine, data, 2)  # warm-up: lazy initialisation and first allocations are not the loop's
    _log_prob(engine, data, 2)
    forward, clip_and_step = engine.forward_micro_batch, engine._clip_and_step
    forwards = []

    def forward_in_error_mode(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        forwards.append(1)
        return forward(*args, **kwargs)

    def step_after_the_loop():
        torch.cuda.set_sync_debug_mode("default")
        return clip_and_step()

    monkeypatch.setattr(engine, "forward_micro_batch", forward_in_error_mode)
    monkeypatch.setattr(engine, "_clip_and_step", step_after_the_loop)
    try:
        metrics = _update(engine, data, 2)
        assert len(forwards) == ROWS // 2 and all(v[0] == v[0] for v in metrics.values())  # 6 micro-batches, no NaN

        def log_prob_forward(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return forward(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(engine, "forward_micro_batch", log_prob_forward)
        _log_prob(engine, data, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
