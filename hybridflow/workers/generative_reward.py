"""`GenerativeRewardWorker`: a generative reward model served for verl's reward loop (GenRM).

With `reward_model.enable=True`, `use_reward_loop=True` and a `custom_reward_function`, verl serves the reward
model as a chat model and the function judges each response by asking it (`rewards.genrm_router` is the HTTP
face). Each rank here is one replica: the causal LM of `reward_model.model.path` in `reward_model.rollout.dtype`,
generating with the `reward_model.rollout.name` engine (hf or native) behind a `GenerationServer` that batches the
concurrent requests of the reward functions. The weights are frozen (nothing hands new ones over); with
`free_cache_engine` the engine's cache exists only while a batch is being judged.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines.rollout import ROLLOUTS, SamplingParams
from hybridflow.engines.rollout.server import GenerationServer, TokenOutput
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
        """Load the reward model into its generation engine; a checkpoint that is not a causal LM raises."""
        serving = self.config.rollout
        model_path, self.tokenizer = prepare_worker_process(self, self.runtime, self.config.model)
        device = get_torch_device(self.local_rank)
        module = build_causal_lm(model_path, dtype=resolve_dtype(serving.dtype, device),
                                 trust_remote_code=self.config.model.trust_remote_code).to(device)
        self.rollout = ROLLOUTS.get(serving.engine)(
            module, self.tokenizer, SamplingParams(max_new_tokens=serving.response_length),
            memory_utilization=serving.gpu_memory_utilization,
        )
        self.max_model_len = serving.prompt_length + serving.response_length
        if serving.free_cache_engine:
            self.rollout.sleep()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wake_up_server(self) -> None:
        """Wake the engine and start this replica's server (before a batch is judged)."""
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
