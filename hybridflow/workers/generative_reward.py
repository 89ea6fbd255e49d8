"""`GenerativeRewardWorker`: a generative reward model served for verl's reward loop (GenRM).

With `reward_model.enable=True`, `use_reward_loop=True` and a `custom_reward_function`, verl serves the reward
model as a chat model and the function judges each response by asking it (`rewards.genrm_router` is the HTTP
face). Each group of `reward_model.rollout.tensor_model_parallel_size` consecutive ranks is one replica: the causal
LM of `reward_model.model.path` in `reward_model.rollout.dtype` (split over the group's ranks by heads, MLP and
vocabulary, each reading its shard from the checkpoint), generating with the `reward_model.rollout.name` engine (hf
or native) behind a `GenerationServer` that batches the concurrent requests of the reward functions (the group's
first rank takes them; the others follow it). The weights are frozen (nothing hands new ones over); with
`free_cache_engine` the engine's cache exists only while a batch is being judged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from hybridflow.engines.rollout import ROLLOUTS, SamplingParams
from hybridflow.engines.rollout.server import GenerationServer, TokenOutput
from hybridflow.engines.training.mesh import ParallelLayout
from hybridflow.models import build_causal_lm
from hybridflow.models.loader import resolve_dtype
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.utils.device import get_torch_device
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.process import prepare_worker_process
from hybridflow.workers.reward_config import RewardModelWorkerConfig

__all__ = ["GenerativeRewardWorker", "SERVER_CONCURRENCY"]

SERVER_CONCURRENCY = 64
"""Requests a replica takes at once (the Ray actor's max_concurrency; its server batches them)."""


class GenerativeRewardWorker(Worker):
    """One replica of the generative reward model: a rollout engine over the frozen model and its server."""

    def __init__(self, config: RewardModelWorkerConfig, runtime: WorkerRuntimeConfig) -> None:
        super().__init__()
        self.config, self.runtime = config, runtime
        self._server: GenerationServer | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the reward model into its generation engine (collective with tensor-parallel replicas: each rank
        reads its shard from the checkpoint)."""
        serving = self.config.rollout
        model_path, self.tokenizer = prepare_worker_process(self, self.runtime, self.config.model)
        device = get_torch_device(self.local_rank)
        dtype = resolve_dtype(serving.dtype, device)
        self.layout = ParallelLayout(self.world_size, serving.tensor_model_parallel_size)
        extra: dict[str, Any] = {}
        if self.layout.tp > 1:  # consecutive groups of tp ranks serve one replica each
            mesh = init_device_mesh(
                device.type, (self.layout.dp, self.layout.tp), mesh_dim_names=("judge_dp", "judge_tp")
            )
            extra = {"tp_mesh": mesh["judge_tp"], "dtype": dtype}
            model: Any = model_path
        else:
            model = build_causal_lm(model_path, dtype=dtype, trust_remote_code=self.config.model.trust_remote_code)
            model = model.to(device)
        self.rollout = ROLLOUTS.get(serving.engine)(
            model, self.tokenizer, SamplingParams(max_new_tokens=serving.response_length),
            memory_utilization=serving.gpu_memory_utilization, **extra,
        )
        self.max_model_len = serving.prompt_length + serving.response_length
        self._wake_ups = 0
        if serving.free_cache_engine:
            self.rollout.sleep()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wake_up_server(self) -> None:
        """Wake the engine and start this replica's server (before a batch is judged). Each replica samples from
        its own stream; the ranks of a tensor-parallel replica share it, so that they draw the same tokens."""
        self._wake_ups += 1
        torch.manual_seed(self.runtime.seed + 1_000_003 * (self.layout.dp_rank(self.rank) + 1) + self._wake_ups)
        self.rollout.wake_up()
        if self._server is None:
            self._server = GenerationServer(
                self.rollout, self.tokenizer.pad_token_id, max_batch_size=SERVER_CONCURRENCY,
                max_model_len=self.max_model_len,
            )
        self._server.start()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_server(self) -> dict[str, float]:
        """Stop the server after its queued requests; free the engine's cache (`free_cache_engine`)."""
        stats: dict[str, Any] = {}
        if self._server is not None:
            self._server.stop()
            stats = {f"reward_model/server/{key}": value for key, value in self._server.stats().items()}
            self._server = None
        if self.config.rollout.free_cache_engine:
            self.rollout.sleep()
        return stats

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def generate_tokens(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> TokenOutput:
        """One request to this replica's server; concurrent calls are batched together."""
        if self._server is None or not self._server.running:
            raise RuntimeError("the generative reward model is asleep: wake_up_server before judging")
        return self._server.generate(request_id, prompt_ids, sampling_params)
