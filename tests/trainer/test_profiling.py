"""Profiling with verl's keys (`global_profiler`, each role's `profiler`): the settings that would profile nothing or
with a tool hybridflow lacks are refused before Ray; the schedule starts and stops the right pools' ranks at the
profiled steps; a process's recording writes a Chrome trace with the step's ops; and a 2-rank GRPO run writes the
traces of the asked ranks and steps only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.profiling import StepProfiling, pool_request
from hybridflow.utils.profiler_config import GlobalProfilerConfig
from hybridflow.utils.step_profiler import ProfileRequest, StepProfiler
from tests.helpers import grpo_overrides, nothing_started
from tests.trainer.placement_runs import overrides, train, train_file, workspace  # noqa: F401 (fixtures)

TORCH_STEPS = ["global_profiler.tool=torch", "global_profiler.steps=[1,2]"]
ACTOR = "actor_rollout_ref.actor.profiler"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ([f"{ACTOR}.enable=True"], "actor.profiler.enable=True profiles nothing"),
        (["global_profiler.tool=nsys", "global_profiler.steps=[1]", f"{ACTOR}.enable=True"],
         "tool='nsys' with global_profiler.steps=[1]: NVIDIA Nsight Systems"),
        (["global_profiler.tool=npu", "global_profiler.steps=[1]"], "the npu profiler is Ascend's"),
        (TORCH_STEPS, "profiles no process: no role of this run enables it"),
        ([*TORCH_STEPS, f"{ACTOR}.enable=True", f"{ACTOR}.tool_config.torch.discrete=True"], "discrete=True"),
        ([*TORCH_STEPS, f"{ACTOR}.enable=True", f"{ACTOR}.tool_config.torch.contents=[gpu]"], "contents"),
        ([*TORCH_STEPS, f"{ACTOR}.enable=True", f"{ACTOR}.ranks=[3]"], "ranks [3] are beyond the 2 ranks"),
        ([*TORCH_STEPS, f"{ACTOR}.enable=True", f"{ACTOR}.tool=torch_memory"], "differs from global_profiler.tool"),
        (["global_profiler.tool=torch_memory", "global_profiler.steps=[1]", f"{ACTOR}.enable=True",
          "trainer.device=cpu"], "torch_memory records CUDA allocations"),
        (["global_profiler.tool=torch", "global_profiler.steps=[0]"], "training steps count from 1"),
    ],
)
def test_profiling_that_cannot_happen_is_refused_before_ray(train_file, extra, words):  # noqa: F811
    with nothing_started(), pytest.raises(ValueError) as info:
        validate_config(load_config([*grpo_overrides(train_file), *extra]))
    assert words in str(info.value), str(info.value)


def test_verl_profiler_lines_are_taken(train_file):  # noqa: F811
    """A verl line's profiler keys (nsys options left at rest, a role's ranks, the memory tool's settings)."""
    cfg = load_config([
        *grpo_overrides(train_file), *TORCH_STEPS, "global_profiler.profile_continuous_steps=True",
        "global_profiler.save_path=/tmp/profile", f"{ACTOR}.enable=True", f"{ACTOR}.all_ranks=False",
        f"{ACTOR}.ranks=[0]", f"{ACTOR}.tool_config.torch.contents=[cpu,shapes]",
        "global_profiler.global_tool_config.nsys.discrete=False",
        "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=1000",
    ])
    validate_config(cfg)
    rollout = cfg.actor_rollout_ref.rollout.profiler  # follows the actor's, as in verl
    assert (rollout.enable, rollout.ranks, rollout.tool, rollout.save_path) == (True, [0], "torch", "/tmp/profile")
    assert cfg.actor_rollout_ref.actor.profiler.tool_config.torch_memory.trace_alloc_max_entries == 1000
    assert cfg.global_profiler.step_runs() == [(1, 2)]


def test_step_runs_split_at_gaps_unless_continuous():
    steps = [5, 1, 2, 3, 8]
    assert GlobalProfilerConfig(tool="torch", steps=steps).step_runs() == [(1, 1), (2, 2), (3, 3), (5, 5), (8, 8)]
    continuous = GlobalProfilerConfig(tool="torch", steps=steps, profile_continuous_steps=True)
    assert continuous.step_runs() == [(1, 3), (5, 5), (8, 8)]
    assert not GlobalProfilerConfig(tool="torch", steps=[]).profiles and not GlobalProfilerConfig(steps=[1]).profiles


class _Group:
    def __init__(self, world_size: int) -> None:
        self.world_size, self.calls = world_size, []

    def start_profile(self, request):
        self.calls.append(("start", request))
        return [rank in request.ranks for rank in range(self.world_size)]

    def stop_profile(self):
        self.calls.append(("stop", None))
        return [[f"/p/rank{rank}.json"] for rank in range(self.world_size)]


class _Pool:
    def __init__(self, name: str, roles: tuple[str, ...], world_size: int) -> None:
        self.name, self.roles, self.group = name, roles, _Group(world_size)


def test_the_schedule_starts_the_asked_pools_ranks_at_their_steps(train_file, tmp_path):  # noqa: F811
    cfg = load_config([
        *grpo_overrides(train_file), "global_profiler.tool=torch", "global_profiler.steps=[2,3,5]",
        "global_profiler.profile_continuous_steps=True", f"global_profiler.save_path={tmp_path}",
        f"{ACTOR}.enable=True", f"{ACTOR}.ranks=[1,3]", "critic.profiler.enable=True",
        "critic.profiler.all_ranks=True",
    ])
    trainer_pool, rollout_pool = _Pool("hybridflow_trainer_pool", ("actor", "ref"), 4), _Pool("hybridflow_rollout", ("rollout",), 2)
    critic_pool = _Pool("hybridflow_critic_pool", ("critic",), 2)
    request = pool_request(cfg, trainer_pool.roles, 4, "trainer_pool")
    assert request.ranks == [1, 3] and request.tool == "torch"
    assert pool_request(cfg, rollout_pool.roles, 2, "rollout").ranks == [1]  # the actor's ranks, within the pool
    assert pool_request(cfg, critic_pool.roles, 2, "critic").ranks == [0, 1]
    schedule = StepProfiling(cfg, [trainer_pool, rollout_pool, critic_pool])
    metrics = {}
    for step in range(1, 6):
        schedule.begin(step)
        metrics[step] = schedule.end(step, is_last=step == 5)
    starts = [request for kind, request in trainer_pool.group.calls if kind == "start"]
    assert [Path(request.directory).name for request in starts] == ["steps2-3", "step5"]
    assert all(Path(request.directory).parent == tmp_path for request in starts)
    assert [kind for kind, _ in critic_pool.group.calls] == ["start", "stop", "start", "stop"]
    assert metrics == {1: {}, 2: {}, 3: {"profile/files": 8.0}, 4: {}, 5: {"profile/files": 8.0}}
    # A run of steps cut short by the end of training is still written.
    cut = StepProfiling(load_config([
        *grpo_overrides(train_file), "global_profiler.tool=torch", "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=True", f"{ACTOR}.enable=True",
    ]), [_Pool("hybridflow_global_pool", ("actor", "rollout"), 1)])
    cut.begin(2)
    assert cut.end(2, is_last=True) == {"profile/files": 1.0}


def test_a_recording_writes_a_chrome_trace_and_its_top_ops(tmp_path):
    request = ProfileRequest(tool="torch", ranks=[0], directory=str(tmp_path / "step1"), label="pool",
                             contents=["cpu", "shapes"])
    profiler = StepProfiler(request, rank=0, device=torch.device("cpu"))
    profiler.start()
    torch.randn(64, 64) @ torch.randn(64, 64)
    trace, table = profiler.stop()
    assert trace.endswith("step1/pool_rank0.json") and table.endswith("step1/pool_rank0.txt")
    events = json.loads(Path(trace).read_text())["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events)
    assert "aten::mm" in Path(table).read_text()
    with pytest.raises(RuntimeError, match="torch_memory records CUDA allocations.*runs on cpu"):
        StepProfiler(ProfileRequest(tool="torch_memory", ranks=[0], directory="", label="pool"), 0, torch.device("cpu"))


def test_worker_processes_record_on_their_ranks_only(tmp_path):
    """`Worker.start_profile` / `stop_profile` through a worker group: rank 1 of 2 records, rank 0 does not."""
    from hybridflow.single_controller import Worker
    from hybridflow.single_controller.local import LocalWorkerGroup
    from hybridflow.single_controller.ray.base import RayClassWithInitArgs

    group = LocalWorkerGroup(RayClassWithInitArgs(Worker), world_size=2)
    request = ProfileRequest(tool="torch", ranks=[1], directory=str(tmp_path / "step3"), label="pool")
    assert group.start_profile(request) == [False, True]
    with pytest.raises(RuntimeError, match="start_profile while a profile is recording"):
        group.workers[1].start_profile(request)
    torch.randn(8, 8) @ torch.randn(8, 8)
    written = group.stop_profile()
    assert written[0] == [] and [Path(path).name for path in written[1]] == ["pool_rank1.json", "pool_rank1.txt"]
    assert group.stop_profile() == [[], []]  # nothing is recording any more


@pytest.mark.slow  # a Ray run (about 15 s); the pieces it wires are tested above in the default suite
def test_grpo_writes_the_traces_of_the_asked_rank_and_steps(workspace, ray_cluster):  # noqa: F811
    save = workspace / "profile"
    records, _ = train(overrides(
        workspace, workspace / "profiled", "global_profiler.tool=torch", "global_profiler.steps=[2]",
        f"global_profiler.save_path={save}", f"{ACTOR}.enable=True", f"{ACTOR}.ranks=[1]",
    ))
    assert sorted(path.name for path in save.rglob("*")) == ["global_pool_rank1.json", "global_pool_rank1.txt", "step2"]
    events = json.loads((save / "step2" / "global_pool_rank1.json").read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert "aten::mm" in names or "aten::addmm" in names  # the step's forwards and backwards
    assert "profile/files" not in records[1] and records[2]["profile/files"] == 2.0
