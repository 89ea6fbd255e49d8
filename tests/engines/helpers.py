"""Shared test helpers: tiny batches, prompt encoding, a simple loss, a 2-process gloo launcher, and the check that
the native rollout's sampled log-probs are the training engine's."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.engines.rollout import NativeRollout, SamplingParams
from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.env import set_dist_env
from hybridflow.models import build_causal_lm
from hybridflow.protocol import DataProto
from tests.fork_server import use_rank_preload


def encode_prompts(tokenizer, texts: list[str], meta_info: dict | None = None) -> DataProto:
    """Left-padded prompts with verl's position ids (clip(cumsum(mask) - 1, 0))."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "position_ids": position_ids}
    return DataProto.from_dict(tensors=tensors, meta_info=meta_info or {})


def make_batch(
    vocab_size: int, batch_size: int = 8, prompt_len: int = 6, response_len: int = 5, seed: int = 0
) -> DataProto:
    """Random prompt+response rows: left-padded prompts, right-padded responses of varying length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch_size, prompt_len + response_len), generator=gen)
    prompt_lens = torch.randint(1, prompt_len + 1, (batch_size,), generator=gen)
    resp_lens = torch.randint(1, response_len + 1, (batch_size,), generator=gen)
    cols = torch.arange(prompt_len + response_len)
    prompt_mask = (cols[None, :prompt_len] >= prompt_len - prompt_lens[:, None]).long()
    response_mask = (cols[None, :response_len] < resp_lens[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = torch.where(attention_mask.bool(), ids, 2)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": ids[:, prompt_len:],
        "response_mask": response_mask,
    }
    return DataProto.from_dict(tensors=tensors)


def seq_mean_nll(outputs: dict[str, torch.Tensor], micro_batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over sequences of the per-sequence token-mean negative log-likelihood of the responses."""
    mask = micro_batch.batch["response_mask"].to(outputs["log_probs"].dtype)
    per_seq = -(outputs["log_probs"] * mask).sum(-1) / mask.sum(-1)
    loss = per_seq.mean()
    return loss, {"nll": loss.item()}


def _entry(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    set_dist_env(rank, world_size, local_rank=rank, master_addr="127.0.0.1", master_port=str(port))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` processes joined by a `backend` group.

    CPU ranks are forked from a fork server (`tests.fork_server.RANK_PRELOAD` imported once, no thread or device
    touched): they start as clean as spawned ones, without paying the imports again. Ranks of an nccl group are
    spawned. The rendezvous store listens in this process on a port the OS picks, from before the ranks start until
    they end: no other process can take the port in between (a port found free and released could be taken)."""
    # CUDA ranks are spawned: the fork server's imports may query the driver, and CUDA does not survive a fork.
    start_method = "spawn" if "nccl" in backend else "forkserver"
    if start_method == "forkserver":
        use_rank_preload()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    mp.start_processes(
        _entry, args=(world_size, store.port, backend, fn, args), nprocs=world_size, join=True,
        start_method=start_method,
    )


def assert_native_log_probs_match_engine(model_dir, tokenizer, texts: list[str], kernels: str) -> None:
    """Sample 2 x 8 tokens per prompt with the native rollout (temperature 0.7, top-k 50, top-p 0.9) and check that
    the log-probs it returns equal the training engine's for the same tokens, to 1e-4."""
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=8, n=2)
    rollout = NativeRollout(build_causal_lm(model_dir), tokenizer, params, max_num_seqs=4, kernels=kernels)
    torch.manual_seed(0)
    out = rollout.generate_sequences(encode_prompts(tokenizer, texts))
    engine = build_fsdp_engine(model_dir, FSDPEngineConfig(micro_batch_size_per_gpu=4))
    log_probs, _ = engine.compute_log_prob(out, temperature=0.7)
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)
