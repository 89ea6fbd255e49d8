"""What every trainer's driver builds the same way: tokenizer, data loaders, worker processes, Ray, tracking.

Each function takes the config sections it reads, never a trainer object, so the PPO and SFT trainers (and
users' own drivers) share them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hybridflow import env
from hybridflow.data import build_sampler
from hybridflow.data.config import expand_path
from hybridflow.models import MODEL_CATALOGUE, catalogue_tokenizer_path, load_tokenizer, resolve_model_path
from hybridflow.models.config import ModelConfig
from hybridflow.models.loader import with_chat_template
from hybridflow.protocol import DataProto
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, describe_cluster
from hybridflow.trainer.checkpoint_dirs import resume_candidate
from hybridflow.trainer.config.schema import RayInitConfig, RunConfig
from hybridflow.trainer.tracking import METRICS_FILE, Tracking
from hybridflow.utils.device import device_count
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.registrations import driver_registrations

logger = logging.getLogger(__name__)


def build_tokenizer(model: ModelConfig, trust_remote_code: bool = False) -> Any:
    """The driver's tokenizer (catalogue models: the tokenizer only, without converting the weights here); the
    repository's own code runs when `model.trust_remote_code` or `trust_remote_code` (data.trust_remote_code) allows."""
    location = model.tokenizer_location
    if location in MODEL_CATALOGUE:
        tokenizer = load_tokenizer(catalogue_tokenizer_path(location))
    else:
        trusted = model.trust_remote_code or trust_remote_code
        tokenizer = load_tokenizer(resolve_model_path(location), trust_remote_code=trusted)
    return with_chat_template(tokenizer, model.custom_chat_template)


def build_processor(model: ModelConfig, tokenizer: Any, trust_remote_code: bool = False) -> Any:
    """The driver's `VisionProcessor` for a vision-language model (images in the data), None for a text model."""
    if model.path in MODEL_CATALOGUE:  # the catalogue holds text models only
        return None
    from hybridflow.models.vision import load_processor

    trusted = model.trust_remote_code or trust_remote_code
    return load_processor(resolve_model_path(model.path), tokenizer, trust_remote_code=trusted)


def build_train_loader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int | None,
                       collate_fn: Callable[[list], Any], sampler: Sampler | None = None) -> DataLoader:
    """Full batches only, in a seeded order that `sampler.state_dict()` can resume exactly (or in the order of
    `sampler`, a user's `UserSampler`)."""
    if len(dataset) < batch_size:
        raise ValueError(
            f"data.train_batch_size={batch_size} is larger than the {len(dataset)} usable training samples; "
            "lower it or add data"
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler if sampler is not None else build_sampler(dataset, shuffle=shuffle, seed=seed),
        collate_fn=collate_fn,
        drop_last=True,
        num_workers=0,  # keeps the sampler position exact for resume
    )


def build_val_loader(
    dataset: Dataset, batch_size: int | None, collate_fn: Callable[[list], Any], shuffle_seed: int | None = None
) -> DataLoader:
    """Every validation sample once (`batch_size` None: all at once), in order, or shuffled by `shuffle_seed`."""
    generator = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
    return DataLoader(dataset, batch_size=batch_size or len(dataset), shuffle=shuffle_seed is not None,
                      generator=generator, collate_fn=collate_fn, num_workers=0)


def use_accelerator(run: RunConfig) -> bool:
    """Whether workers get accelerators, per `trainer.device`. auto means: GPUs in the Ray cluster the workers run
    on (a CPU-only head or driver, as with `ray job submit`, must not hide the GPU nodes), or in this process in
    local mode. cuda on a cluster without GPUs is an error."""
    if run.device == "cpu":
        return False
    if run.local_mode:
        available = device_count() > 0
    else:
        import ray

        available = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    if run.device == "cuda" and not available:
        where = "this process" if run.local_mode else "the Ray cluster"
        raise RuntimeError(f"trainer.device='cuda' but {where} has no GPU; use trainer.device=auto or cpu")
    return available


def worker_runtime(
    run: RunConfig, total_training_steps: int, num_processes: int | None = None, collective_timeout_s: int | None = None
) -> WorkerRuntimeConfig:
    """Seed, schedule length, torch threads and collective timeout of each worker (CPU workers share the machine's
    cores: the `num_processes` of all pools, `run.world_size` by default)."""
    threads = run.num_threads_per_worker
    if threads == 0 and not use_accelerator(run):
        threads = max(1, (os.cpu_count() or 1) // (num_processes or run.world_size))
    return WorkerRuntimeConfig(total_training_steps=total_training_steps, seed=run.seed, num_threads=threads,
                               collective_timeout_s=collective_timeout_s, registrations=driver_registrations())


class WorkerProcesses:
    """The processes that host a trainer's workers: in the driver (local mode) or Ray actors in one pool."""

    def __init__(
        self, run: RunConfig, worker: RayClassWithInitArgs, name_prefix: str, pool: RayResourcePool | None = None,
        roles: Sequence[str] = (),
    ) -> None:
        """Start one process per rank of `pool` (default: `trainer.nnodes x n_gpus_per_node`) for `worker`, which
        hosts `roles` (the config's role names: actor, rollout, ref, critic, reward_model)."""
        self.name = name_prefix
        self.roles = tuple(roles)
        self.pool: RayResourcePool | None = None
        if run.local_mode:
            self.group: Any = LocalWorkerGroup(worker, world_size=1)
            return
        self.pool = pool or RayResourcePool(
            [run.n_gpus_per_node] * run.nnodes, use_gpu=use_accelerator(run), name_prefix=f"{name_prefix}_pool"
        )
        self.group = RayWorkerGroup(
            self.pool, worker, name_prefix=name_prefix, rpc_timeout_s=run.rpc_timeout_s, stack_dump_dir=str(run_dir(run))
        )

    def check_alive(self, timeout_s: float) -> int:
        """Ping every process (see `RayWorkerGroup.check_alive`); the number that answered."""
        return self.group.check_alive(timeout_s)

    def shutdown(self) -> None:
        """Kill the worker processes and release their placement group."""
        if isinstance(self.group, RayWorkerGroup):
            self.group.shutdown()
        if self.pool is not None:
            self.pool.release()


def heartbeat(processes: Sequence[WorkerProcesses], timeout_s: float | None) -> dict[str, float]:
    """Between steps: every worker process must answer a ping within `timeout_s` (`trainer.heartbeat_timeout_s`;
    None skips it), else the run stops naming the group and rank (dead: `WorkerError`, hung or stopped:
    `WorkerTimeoutError`). Returns `workers/alive`, the number of processes that answered."""
    if timeout_s is None:
        return {}
    return {"workers/alive": float(sum(process.check_alive(timeout_s) for process in processes))}


EMBEDDED_WORKER_NICENESS = 0


def init_ray(ray_init: RayInitConfig, world_size: int) -> None:
    """Join `ray_init.address` / RAY_ADDRESS (the key first), or start the embedded one-node cluster sized for the
    workers; log which, with the cluster's nodes."""
    import ray

    if ray.is_initialized():
        return
    address = ray_init.address or env.ray_address()
    if address:
        if ray_init.num_cpus is not None:
            logger.warning("ray_kwargs.ray_init.num_cpus=%d is ignored: the cluster at %s has its own resources",
                           ray_init.num_cpus, address)
        ray.init(address=address, log_to_driver=True)
        logger.info("joined the Ray cluster at %s: %s", address, describe_cluster())
        return
    num_cpus = ray_init.num_cpus or max(os.cpu_count() or 1, world_size)
    # "local": a new cluster even where `ray start` left its address in Ray's temp dir (address=None would join it).
    # Worker niceness 0 (Ray's default is 15): the workers do all of the training's compute, and a niced worker
    # yields nearly all of its CPU to any ordinary process beside it (measured on 2 cores: a demo step went from
    # 12 s to 1022 s while a test run shared the machine). A cluster joined by address keeps its own setting.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             _system_config={"worker_niceness": EMBEDDED_WORKER_NICENESS})
    logger.info("started an embedded Ray cluster (set RAY_ADDRESS to join one): %s", describe_cluster())


def write_ray_timeline(path: str | None) -> None:
    """Ray's timeline of the run's tasks (`ray_kwargs.timeline_json_file`), a Chrome trace; nothing without Ray."""
    if path is None:
        return
    import ray

    if not ray.is_initialized():
        logger.warning("ray_kwargs.timeline_json_file=%r: no Ray cluster ran (local mode); nothing written", path)
        return
    target = expand_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    ray.timeline(filename=str(target))
    logger.info("wrote Ray's timeline to %s", path)


def build_tracking(run: RunConfig, config: Any, backends: Sequence[str] | None = None) -> Tracking:
    """Tracking of the run into `trainer.default_local_dir` with the whole config recorded. A run that starts at
    step 0 moves an earlier run's metrics file aside first (a run without checkpoints, or a different one): they
    were appended to, and their steps mixed with this run's in the plots."""
    root = run_dir(run)
    if resume_candidate(run.resume_mode, run.resume_from_path, root) is None:
        earlier = root / METRICS_FILE
        if earlier.is_file() and earlier.stat().st_size:
            kept = earlier.with_name(f"{METRICS_FILE}.before-{time.strftime('%Y%m%dT%H%M%S')}")
            earlier.rename(kept)
            logger.warning("%s held an earlier run's metrics; this run starts at step 0, so they were moved to %s",
                           earlier, kept.name)
    return Tracking(
        list(run.logger if backends is None else backends),
        run_dir(run),
        run.project_name,
        run.experiment_name,
        asdict(config),
    )


def run_dir(run: RunConfig) -> Path:
    """The run's directory (checkpoints and metrics), absolute: Ray workers may run elsewhere."""
    return run.local_dir().resolve()


def total_steps(run: RunConfig, batches_per_epoch: int) -> int:
    """`trainer.total_training_steps`, or epochs x batches per epoch, whichever is smaller (as verl's loop, which
    ends with its last epoch); a warning says so when the data cuts the steps that were asked for."""
    total = batches_per_epoch * run.total_epochs
    if run.total_training_steps and run.total_training_steps > total:
        logger.warning(
            "trainer.total_training_steps=%d but trainer.total_epochs=%d x %d batches per epoch = %d: the run stops "
            "after %d steps; raise trainer.total_epochs (or add data) for more", run.total_training_steps,
            run.total_epochs, batches_per_epoch, total, total,
        )
    return min(total, run.total_training_steps or total)


def due(freq: int, step: int, is_last: bool, *, at_end_when_off: bool = False) -> bool:
    """Whether a periodic action (validation, checkpoint) runs at `step`: every `freq` steps and at the last step.

    `freq <= 0` turns it off, as in verl's PPO trainer (`trainer.save_freq=-1` writes no checkpoint,
    `trainer.test_freq=-1` validates only before training); `at_end_when_off` keeps the last step's run anyway, as
    verl's SFT trainer does."""
    if freq <= 0:
        return is_last and at_end_when_off
    return is_last or step % freq == 0


def worker_metrics(output: DataProto) -> dict[str, float]:
    """The metrics a worker method returned (`meta_info['metrics']`, a list per rank after the gather), averaged
    over ranks and removed from `output` so they do not travel on with the batch."""
    merged = output.meta_info.pop("metrics", {})
    return {key: float(np.mean(value)) for key, value in merged.items()}


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to `timing[name]` (seconds)."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def progress_bar(total: int, done: int):
    """A tqdm bar over training steps."""
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="training steps", unit="step", dynamic_ncols=True)
