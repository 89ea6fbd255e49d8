"""The generative reward model's HTTP address (verl's `reward_router_address`): an OpenAI-style
`POST /v1/chat/completions` in front of the reward model's generation servers.

verl's reward loop hands a custom reward function this address when a reward model is set with the function; the
function writes its own judging prompt, posts it, and parses the judgement into a score (a generative reward
model, e.g. FAPO's). The router listens from the moment it is built (the reward functions are made with its
address before the workers start) and answers once `attach` gives it the replicas; each request's messages go
through the reward model's chat template and the replicas' continuous batching (`AsyncLLMServerManager`: the least
loaded replica). Ray carries the calls to the replicas; HTTP is only the face verl's reward functions expect.

Request fields: `messages` (required), `model` (echoed back; one model is served), `temperature`, `top_p`,
`top_k`, `max_tokens` / `max_completion_tokens`, `n`, `stream` (false only). Any other field (`seed`, `stop`,
`logprobs`, `tools`, ...) is refused with HTTP 400 naming it, rather than ignored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridflow.engines.rollout.base import SamplingParams

__all__ = ["BadRequest", "ChatCompletionsRouter", "ChatRequest", "parse_chat_request"]

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
_KNOWN_FIELDS = {"messages", "model", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n",
                 "stream"}


class BadRequest(ValueError):
    """A request this server cannot serve as asked (HTTP 400, naming the field)."""


class ChatRequest:
    """A parsed chat-completions request: the conversation, the sampling of each choice, how many choices."""

    def __init__(self, messages: list[dict], sampling: SamplingParams, n: int, model: str) -> None:
        self.messages, self.sampling, self.n, self.model = messages, sampling, n, model


def parse_chat_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """The request, or `BadRequest` naming the field that cannot be served."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise BadRequest(f"unsupported request fields {unknown}; this server takes {sorted(_KNOWN_FIELDS)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise BadRequest("messages must be a non-empty list of {'role': str, 'content': str}")
    if body.get("stream", False):
        raise BadRequest("stream=true is not supported: the whole completion is returned at once")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    n = body.get("n", 1)
    for name, value in (("max_tokens", max_tokens), ("n", n)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    if max_tokens > default_max_tokens:
        raise BadRequest(f"max_tokens={max_tokens} exceeds the served response length {default_max_tokens} "
                         "(reward_model.rollout.response_length)")
    try:
        sampling = SamplingParams(
            temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
            top_k=int(body.get("top_k", -1)), max_new_tokens=max_tokens,
        )
    except (TypeError, ValueError) as err:
        raise BadRequest(f"sampling fields: {err}") from None
    return ChatRequest(messages, sampling, n, str(body.get("model", "")))


ReplicaCall = Callable[..., Awaitable[Any]]


class ChatCompletionsRouter:
    """An HTTP server on `host` (a free port) answering chat completions from the attached replicas; a request
    whose completions take longer than `request_timeout_s` answers 504 (None: no limit)."""

    def __init__(self, host: str, max_tokens: int, max_model_len: int, request_timeout_s: float | None = None) -> None:
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.request_timeout_s = request_timeout_s
        self._manager: Any = None
        self._tokenizer: Any = None
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="genrm-router-loop", daemon=True)
        self._loop_thread.start()
        self._server = ThreadingHTTPServer((host, 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="genrm-router", daemon=True)
        self._thread.start()
        self.address = f"{host}:{self._server.server_address[1]}"
        self.requests = 0
        """Requests answered so far (handler threads count under `_count_lock`)."""
        self._count_lock = threading.Lock()

    def attach(self, replicas: Sequence[ReplicaCall], tokenizer: Any) -> None:
        """Serve from `replicas` (`WorkerGroup.direct_callers("generate_tokens")`), templating with `tokenizer`."""
        from hybridflow.agents.server_manager import AsyncLLMServerManager

        self._manager, self._tokenizer = AsyncLLMServerManager(replicas), tokenizer

    def close(self) -> None:
        """Stop answering, then stop and close the event loop (its thread ends)."""
        self._server.shutdown()
        self._server.server_close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        self._manager = None  # its replica callers hold Ray actor handles

    def complete(self, body: Any) -> dict:
        """The chat-completion response to `body` (`BadRequest`; RuntimeError: nothing attached or asleep)."""
        if self._manager is None:
            raise RuntimeError("the reward model's servers are not attached yet")
        request = parse_chat_request(body, self.max_tokens)
        tokenizer = self._tokenizer
        text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) + request.sampling.max_new_tokens > self.max_model_len:
            raise BadRequest(f"the prompt's {len(prompt_ids)} tokens + max_tokens={request.sampling.max_new_tokens} "
                             f"exceed the served length {self.max_model_len} (reward_model.rollout.max_model_len)")
        request_id = f"genrm-{next(self._ids)}"
        futures = [
            asyncio.run_coroutine_threadsafe(
                self._manager.generate(f"{request_id}-{index}", prompt_ids, request.sampling), self._loop
            )
            for index in range(request.n)
        ]
        try:
            outputs = [future.result(timeout=self.request_timeout_s) for future in futures]
        except concurrent.futures.TimeoutError:
            for future in futures:
                future.cancel()
            raise TimeoutError(f"the reward model gave no completion within {self.request_timeout_s} s") from None
        with self._count_lock:  # handler threads run at once; += on an attribute is not atomic
            self.requests += 1
        return _completion(request_id, request.model, prompt_ids, outputs, tokenizer)


def _completion(request_id: str, model: str, prompt_ids: list[int], outputs: list, tokenizer: Any) -> dict:
    choices = []
    for index, output in enumerate(outputs):
        text = tokenizer.decode(output.token_ids, skip_special_tokens=True)
        choices.append({"index": index, "message": {"role": "assistant", "content": text},
                        "finish_reason": output.finish_reason, "logprobs": None})
    completion_tokens = sum(len(output.token_ids) for output in outputs)
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
    }


def _handler_for(router: ChatCompletionsRouter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != CHAT_PATH:
                return self._reply(404, {"error": {"message": f"unknown path {self.path}; POST {CHAT_PATH}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
                return self._reply(200, router.complete(body))
            except (BadRequest, json.JSONDecodeError) as err:
                return self._reply(400, {"error": {"message": str(err), "type": "invalid_request_error"}})
            except RuntimeError as err:
                return self._reply(503, {"error": {"message": str(err)}})
            except TimeoutError as err:
                return self._reply(504, {"error": {"message": str(err)}})
            except Exception as err:  # a replica failed: the reward function sees it (and its sample scores 0)
                logger.exception("generative reward model request failed")
                return self._reply(500, {"error": {"message": f"{type(err).__name__}: {err}"}})

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            logger.debug("genrm router: " + format, *args)

    return Handler
