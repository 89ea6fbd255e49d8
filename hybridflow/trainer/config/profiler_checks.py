"""Checks across `global_profiler` and the roles' `profiler` sections, before Ray starts: every setting that asks
for a profile gets one, or is refused with the reason (`hybridflow.utils.profiler_config`)."""

from __future__ import annotations

from typing import Any

from hybridflow.utils.profiler_config import PROFILED_SECTIONS, RUNNABLE_TOOLS, UNAVAILABLE_TOOLS, RoleProfilerConfig

ROLE_KEYS = {role: f"{section}.profiler" for role, section in PROFILED_SECTIONS.items()}
"""Each role's profiler key (for messages), by the role names pools are built with."""


def role_profilers(config: Any) -> dict[str, RoleProfilerConfig]:
    """Each role's `profiler` section, by the role names pools are built with."""
    return {role: _section(config, key) for role, key in ROLE_KEYS.items()}


def _section(config: Any, key: str) -> Any:
    """The part of `config` at the dotted `key`."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def check_profiling(cfg: Any, roles_in_run: set[str]) -> None:
    """Refuse a role that enables profiling with nothing to profile, a role tool other than the global one, a run
    that profiles steps on no role, ranks beyond the pool and torch_memory without CUDA workers."""
    profiler = cfg.global_profiler
    profilers = role_profilers(cfg)
    enabled = {role: profilers[role] for role in ROLE_KEYS if role in roles_in_run and profilers[role].enable}
    for role, section in enabled.items():
        key = ROLE_KEYS[role]
        if section.tool is not None and section.tool != profiler.tool:
            raise ValueError(
                f"{key}.tool={section.tool!r} differs from global_profiler.tool={profiler.tool!r}: one tool profiles "
                f"a step; set global_profiler.tool={section.tool} and leave {key}.tool"
            )
        if not profiler.profiles:
            raise ValueError(
                f"{key}.enable=True profiles nothing: global_profiler.tool={profiler.tool!r} and "
                f"global_profiler.steps={profiler.steps}; set global_profiler.tool=torch and global_profiler.steps "
                f"(e.g. [1,2]), or {key}.enable=False"
            )
        pool, pool_size = _pool_of(cfg, role)
        beyond = [rank for rank in section.ranks if rank >= pool_size]
        if beyond and not section.all_ranks:
            raise ValueError(f"{key}.ranks={section.ranks}: ranks {beyond} are beyond the {pool_size} ranks of {pool}")
    if not profiler.profiles:
        return
    assert profiler.tool in RUNNABLE_TOOLS and profiler.tool not in UNAVAILABLE_TOOLS  # the section refused others
    if not enabled:
        keys = ", ".join(f"{ROLE_KEYS[role]}.enable" for role in ROLE_KEYS if role in roles_in_run)
        raise ValueError(
            f"global_profiler.tool={profiler.tool!r} with steps={profiler.steps} profiles no process: no role of "
            f"this run enables it; set one of {keys} to True"
        )
    if profiler.tool == "torch_memory":
        _check_cuda_workers(cfg)


def _pool_of(cfg: Any, role: str) -> tuple[str, int]:
    """The pool hosting `role` (in words) and its number of ranks."""
    from hybridflow.trainer.placement import is_split

    if role == "rollout" and is_split(cfg):
        return "the rollout pool (rollout.nnodes x rollout.n_gpus_per_node)", cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    return "the pool (trainer.nnodes x trainer.n_gpus_per_node)", cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def _check_cuda_workers(cfg: Any) -> None:
    run = cfg.trainer
    if run.workers_on_cpu(cfg.ray_kwargs.ray_init.address):
        where = "trainer.device=cpu" if run.device == "cpu" else "this machine has no CUDA device"
        raise ValueError(
            f"global_profiler.tool=torch_memory records CUDA allocations, but {where}; use global_profiler.tool=torch"
        )
