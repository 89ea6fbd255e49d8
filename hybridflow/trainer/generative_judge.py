"""The driver's side of a generative reward model (verl's reward loop with a custom reward function).

`GenerativeJudge` owns the HTTP router the reward functions post to (`rewards.genrm_router`, listening before the
workers start, so the functions are made with its address), attaches it to the reward-model replicas once they
run (`GenerativeRewardWorker`), and wakes them only while a batch is being scored: `JudgedRewardManager` wraps the
training and validation reward managers so that every scoring call, wherever the trainer makes it, has the judge
awake, and the judge sleeps again before the actor trains (its engine's cache freed, as verl's colocated reward
loop does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.rewards.custom import GenerativeRewardFunction, load_custom_reward_fn
from hybridflow.rewards.genrm_router import ChatCompletionsRouter
from hybridflow.trainer.config import PPOConfig

__all__ = ["GenerativeJudge", "JudgedRewardManager"]

ROUTER_HOST = "127.0.0.1"
"""The reward functions run in the driver's scorer processes, on the driver's host."""


class GenerativeJudge:
    """The served judge: its router, its tokenizer, and its replicas (after `attach`)."""

    def __init__(self, config: PPOConfig) -> None:
        section = config.reward_model
        self.tokenizer_path = resolve_model_path(section.model.tokenizer_path or section.model.path)
        serving = section.rollout
        max_model_len = serving.max_model_len or serving.prompt_length + serving.response_length
        # a reward function waits at most the scorer's timeout for its sample: past it nobody reads the answer
        self.router = ChatCompletionsRouter(ROUTER_HOST, serving.response_length, max_model_len,
                                            request_timeout_s=section.scoring.timeout_s)
        self.group: Any = None
        self.tensor_parallel_size = serving.tensor_model_parallel_size

    def reward_function(self, path: str, name: str, reward_kwargs: dict[str, Any]) -> GenerativeRewardFunction:
        """The custom reward function, called with the router's address and the judge's tokenizer."""
        loaded = load_custom_reward_fn(path, name, reward_kwargs)
        return GenerativeRewardFunction(
            loaded.path, loaded.name, loaded.reward_kwargs, router_address=self.router.address,
            tokenizer_path=self.tokenizer_path,
        )

    def attach(self, group: Any) -> None:
        """Serve the router's requests from `group`'s replicas (one per tensor_model_parallel_size ranks)."""
        self.group = group
        # a tensor-parallel replica takes requests on its first rank only (the others follow it)
        leaders = group.direct_callers("generate_tokens")[:: self.tensor_parallel_size]
        self.router.attach(leaders, load_tokenizer(self.tokenizer_path))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The replicas awake for the duration (a no-op before `attach`: nothing can be asked then)."""
        if self.group is None:
            yield
            return
        self.group.wake_up_server()
        try:
            yield
        finally:
            self.group.sleep_server()

    def close(self) -> None:
        """Stop the router and drop the replicas' handles (their callers close over Ray actor handles)."""
        self.router.close()
        self.group = None


class JudgedRewardManager:
    """A reward manager whose scoring runs with the judge awake; every other attribute is the manager's."""

    def __init__(self, manager: Any, judge: GenerativeJudge) -> None:
        self.manager, self.judge = manager, judge

    def __call__(self, data: DataProto, *args: Any, **kwargs: Any) -> Any:
        before = self.judge.router.requests
        with self.judge.serving():
            result = self.manager(data, *args, **kwargs)
        result.metrics["reward_model/judge_requests"] = float(self.judge.router.requests - before)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)
