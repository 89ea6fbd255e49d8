"""verl's profiler settings: `global_profiler` (which tool, which steps, where) and each role's `profiler` section
(`actor_rollout_ref.actor.profiler`, `.ref.profiler`, `.rollout.profiler`, `critic.profiler`,
`reward_model.profiler`: whether its processes are profiled, on which ranks). The trainer side is
`hybridflow.trainer.profiling`, the worker side `hybridflow.utils.step_profiler`.

Tools:
- `torch`: `torch.profiler` over each profiled worker process for the profiled steps; one Chrome trace (and a
  table of the top ops) per process and step, under `save_path/step{N}/`.
- `torch_memory`: a CUDA memory snapshot per process and step (`torch.cuda.memory._dump_snapshot`), for
  pytorch.org/memory_viz; needs CUDA workers.
- `nsys` (NVIDIA Nsight Systems) and `npu` (Ascend) are verl's too, but hybridflow's workers are not launched under
  Nsight and do not run on NPUs: asking for them is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hybridflow.utils.config import ConfigFieldError, check_at_least, check_literal_fields, unsupported

PROFILED_SECTIONS = {
    "actor": "actor_rollout_ref.actor",
    "rollout": "actor_rollout_ref.rollout",
    "ref": "actor_rollout_ref.ref",
    "critic": "critic",
    "reward_model": "reward_model",
}
"""The config section holding each role's `profiler`, by the role names worker pools are built with."""

ProfilerTool = Literal["torch", "torch_memory", "nsys", "npu"]
TorchContent = Literal["cuda", "cpu", "memory", "shapes", "stack"]
RUNNABLE_TOOLS = ("torch", "torch_memory")
"""The tools hybridflow runs; the others are refused when a step would be profiled with them."""
_WHOLE_STACKS = "torch.cuda.memory._record_memory_history records whole stacks; it has no depth setting"
UNAVAILABLE_TOOLS = {
    "nsys": "NVIDIA Nsight Systems needs the worker processes launched under nsys, which hybridflow's Ray workers "
            "are not",
    "npu": "the npu profiler is Ascend's, and hybridflow's workers run on CPUs and CUDA GPUs",
}


# ----------------------------------------------------------------------------- each role's section
@dataclass(frozen=True, kw_only=True)
class NsysToolConfig:
    """Nsight Systems (refused when used: see the module doc)."""

    discrete: bool = False
    """verl: one database per task instead of per step."""


@dataclass(frozen=True, kw_only=True)
class NpuToolConfig:
    """Ascend's profiler (refused when used: see the module doc)."""

    contents: list[str] = field(default_factory=list)
    """verl: what to record (npu, cpu, memory, shapes, module, stack)."""
    level: str = "level0"
    """verl: collection level."""
    analysis: bool = True
    """verl: parse the data automatically."""
    discrete: bool = False
    """verl: one database per task."""


@dataclass(frozen=True, kw_only=True)
class TorchToolConfig:
    """`torch.profiler` options of a role."""

    contents: list[TorchContent] = field(default_factory=list)
    """What to record: cuda, cpu (the activities; empty: the CPU, and CUDA on CUDA workers), memory (tensor
    allocations), shapes (input shapes), stack (Python stacks). The union over a process's roles is used."""
    discrete: bool = False
    """True would trace each worker call on its own; hybridflow records one trace per process and profiled step
    (or run of steps), so only False is accepted."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if self.discrete:
            raise ConfigFieldError(
                "discrete",
                "discrete=True (a trace per worker call) is not implemented: each profiled process records one trace "
                "per profiled step (global_profiler.profile_continuous_steps=True: per run of consecutive steps); "
                "set discrete=False",
            )


@dataclass(frozen=True, kw_only=True)
class TorchMemoryToolConfig:
    """CUDA memory-history options of a role (verl's keys; the global section's values are the defaults)."""

    trace_alloc_max_entries: int = 100_000
    """Allocation events kept."""
    stack_depth: int = unsupported(32, _WHOLE_STACKS)
    """verl: frames recorded per allocation."""

    def __post_init__(self) -> None:
        check_at_least("trace_alloc_max_entries", self.trace_alloc_max_entries, 1)


@dataclass(frozen=True, kw_only=True)
class RoleToolConfig:
    """Per-tool options of a role."""

    nsys: NsysToolConfig = field(default_factory=NsysToolConfig)
    npu: NpuToolConfig = field(default_factory=NpuToolConfig)
    torch: TorchToolConfig = field(default_factory=TorchToolConfig)
    torch_memory: TorchMemoryToolConfig = field(default_factory=TorchMemoryToolConfig)


@dataclass(frozen=True, kw_only=True)
class RoleProfilerConfig:
    """Whether the processes hosting this role are profiled at `global_profiler.steps`, and on which ranks."""

    tool: Optional[ProfilerTool] = None
    """The tool (defaults to global_profiler.tool; set it to the same value or leave it)."""
    enable: bool = False
    """Profile this role's processes."""
    all_ranks: bool = False
    """Every rank of the role's pool; else `ranks`, and rank 0 when `ranks` is empty."""
    ranks: list[int] = field(default_factory=list)
    """The pool's ranks to profile."""
    save_path: Optional[str] = None
    """Where the traces go (defaults to global_profiler.save_path; set it to the same value or leave it)."""
    tool_config: RoleToolConfig = field(default_factory=RoleToolConfig)
    """Per-tool options."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        for rank in self.ranks:
            check_at_least("ranks", rank, 0)

    def ranks_of(self, pool_size: int) -> set[int]:
        """The ranks of a pool of `pool_size` processes this role profiles (none when not enabled)."""
        if not self.enable:
            return set()
        if self.all_ranks:
            return set(range(pool_size))
        return set(self.ranks) if self.ranks else {0}


# ----------------------------------------------------------------------------- the global section
@dataclass(frozen=True, kw_only=True)
class NsysGlobalConfig:
    """Nsight Systems' launch options (refused when used: see the module doc)."""

    discrete: bool = False
    """verl: one database per task."""
    controller_nsight_options: dict[str, Any] = field(default_factory=dict)
    """verl: nsys options of the driver."""
    worker_nsight_options: dict[str, Any] = field(default_factory=dict)
    """verl: nsys options of the workers."""


@dataclass(frozen=True, kw_only=True)
class TorchMemoryGlobalConfig:
    """CUDA memory-history recording (`torch.cuda.memory._record_memory_history`)."""

    trace_alloc_max_entries: int = 100_000
    """Allocation events kept."""
    stack_depth: int = unsupported(32, _WHOLE_STACKS)
    """verl: frames recorded per allocation."""
    context: Literal["alloc", "state", "all"] = "all"
    """Events recorded: alloc, state or all."""
    stacks: Literal["python", "all"] = "all"
    """Stacks recorded: python, or all (with C++)."""
    kw_args: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of `_record_memory_history`."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        check_at_least("trace_alloc_max_entries", self.trace_alloc_max_entries, 1)


@dataclass(frozen=True, kw_only=True)
class GlobalToolConfig:
    """Tool options shared by the roles."""

    nsys: NsysGlobalConfig = field(default_factory=NsysGlobalConfig)
    torch_memory: TorchMemoryGlobalConfig = field(default_factory=TorchMemoryGlobalConfig)


@dataclass(frozen=True, kw_only=True)
class GlobalProfilerConfig:
    """Which tool profiles which training steps (verl's `global_profiler`); the roles say which processes."""

    tool: Optional[ProfilerTool] = None
    """torch | torch_memory (nsys and npu are refused); None: no profiling."""
    steps: Optional[list[int]] = None
    """Training steps to profile (1-based), e.g. [1, 2, 5]; None or []: none."""
    profile_continuous_steps: bool = False
    """Consecutive profiled steps share one trace (e.g. steps [1, 2, 5]: one for 1-2, one for 5)."""
    save_path: str = "outputs/profile"
    """Directory of the traces (relative paths: from the directory the trainer starts in)."""
    global_tool_config: GlobalToolConfig = field(default_factory=GlobalToolConfig)
    """Tool options shared by the roles."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        for step in self.steps or []:
            check_at_least("steps", step, 1, "training steps count from 1")
        if self.profiles and self.tool in UNAVAILABLE_TOOLS:
            raise ConfigFieldError(
                "tool",
                f"tool={self.tool!r} with steps={self.steps}: {UNAVAILABLE_TOOLS[self.tool]}; use tool=torch "
                "(torch.profiler traces per worker process) or tool=torch_memory (CUDA memory snapshots)",
            )

    @property
    def profiles(self) -> bool:
        """Whether any step is profiled."""
        return self.tool is not None and bool(self.steps)

    def step_runs(self) -> list[tuple[int, int]]:
        """The (first, last) steps of each trace: one per profiled step, or per run of consecutive steps with
        `profile_continuous_steps`."""
        steps = sorted(set(self.steps or []))
        if not self.profile_continuous_steps:
            return [(step, step) for step in steps]
        runs: list[tuple[int, int]] = []
        for step in steps:
            if runs and runs[-1][1] == step - 1:
                runs[-1] = (runs[-1][0], step)
            else:
                runs.append((step, step))
        return runs
