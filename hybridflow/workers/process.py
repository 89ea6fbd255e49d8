"""Per-process setup shared by the role workers: threads, seed, process group, model path and tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.models.config import ModelConfig
from hybridflow.models.loader import with_chat_template
from hybridflow.models.shm_copy import shm_copy_of
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.registrations import install_registrations
from hybridflow.single_controller import Worker


def prepare_worker_process(worker: Worker, runtime: WorkerRuntimeConfig, model: ModelConfig) -> tuple[str, Any]:
    """Threads, seed and process group of a worker's process (`runtime`); returns (resolved model path, tokenizer).

    Threads: Ray gives 1-CPU actors OMP_NUM_THREADS=1, so torch's count is set deliberately (0 keeps torch's).
    """
    install_registrations(runtime.registrations)
    if runtime.num_threads > 0:
        torch.set_num_threads(runtime.num_threads)
    torch.manual_seed(runtime.seed)
    if worker.world_size > 1:
        worker.init_distributed(timeout_s=runtime.collective_timeout_s)
    model_path = resolve_model_path(model.path)
    if model.use_shm:
        model_path = shm_copy_of(model_path)
    tokenizer_path = resolve_model_path(model.tokenizer_path) if model.tokenizer_path else model_path
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=model.trust_remote_code)
    return model_path, with_chat_template(tokenizer, model.custom_chat_template)
