"""ScorerPool: a raising or hung scorer gives an error/timeout outcome in bounded time; the rest still score."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.rewards import ScorerPool, ScoringConfig, load_custom_reward_fn

SCORERS_FILE = '''
import os
import signal
import time


def score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        if "log" in extra_info:  # when and where each hang started: the test checks that hangs overlapped
            with open(extra_info["log"], "a") as log:
                log.write(f"{os.getpid()} {time.monotonic()}\\n")
        while True:
            pass
    if solution_str == "stuck":  # a hang the worker's alarm cannot break: only killing the worker helps
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            pass
    if solution_str == "raise":
        raise RuntimeError("scorer bug")
    return float(solution_str == ground_truth)
'''


@pytest.fixture
def scorer(tmp_path: Path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS_FILE)
    return load_custom_reward_fn(path, "score")


def call(fn, response: str, log: Path | None = None) -> tuple:
    extra_info = {} if log is None else {"log": str(log)}
    return fn, {"data_source": "x", "solution_str": response, "ground_truth": "ok", "extra_info": extra_info}


def hang_starts(log: Path) -> list[tuple[int, float]]:
    """(worker pid, monotonic start) of each hang, in start order."""
    rows = [line.split() for line in log.read_text().splitlines()]
    return sorted(((int(pid), float(start)) for pid, start in rows), key=lambda row: row[1])


def assert_hung_together(log: Path, count: int, timeout_s: float) -> None:
    """The hangs ran in distinct workers and each started before the first one's alarm: they overlapped in time,
    which one-after-another scoring cannot do (it would start each after the previous alarm)."""
    starts = hang_starts(log)
    assert len(starts) == count, starts
    assert len({pid for pid, _ in starts}) == count, f"hangs shared a worker: {starts}"
    first = starts[0][1]
    assert all(start - first < timeout_s for _, start in starts), f"hangs started one after another: {starts}"


def test_raising_and_hanging_scorers_are_contained(scorer, tmp_path) -> None:
    pool = ScorerPool(ScoringConfig(timeout_s=1.0, num_workers=2))
    try:
        responses = ["ok", "hang", "raise", "no", "hang", "ok"]
        outcomes = pool.run([call(scorer, r, tmp_path / "hangs.log") for r in responses])
        assert [o.status for o in outcomes] == ["ok", "timeout", "error", "ok", "timeout", "ok"]
        assert [o.value for o in outcomes] == [1.0, None, None, 0.0, None, 1.0]
        assert "RuntimeError: scorer bug" in outcomes[2].message
        assert_hung_together(tmp_path / "hangs.log", 2, 1.0)  # interrupted in parallel by the workers' alarms
        workers = pool._pool
        assert [o.value for o in pool.run([call(scorer, "ok")] * 20)] == [1.0] * 20
        assert pool._pool is workers  # no restart was needed
    finally:
        pool.close()


def test_hung_scorers_time_out_together_not_one_after_another(scorer, tmp_path) -> None:
    pool = ScorerPool(ScoringConfig(timeout_s=1.0))  # the default number of scorer processes
    try:
        assert [o.value for o in pool.run([call(scorer, "ok")] * 8)] == [1.0] * 8  # the workers are up
        outcomes = pool.run([call(scorer, "hang", tmp_path / "hangs.log")] * 4 + [call(scorer, "ok")])
        assert [o.status for o in outcomes] == ["timeout"] * 4 + ["ok"]
        assert_hung_together(tmp_path / "hangs.log", 4, 1.0)
    finally:
        pool.close()


def test_a_hang_the_alarm_cannot_break_kills_the_worker(scorer) -> None:
    # 2 s: the well-behaved calls must finish even on a loaded 2-core CI machine.
    pool = ScorerPool(ScoringConfig(timeout_s=2.0, num_workers=2))
    try:
        start = time.monotonic()
        outcomes = pool.run([call(scorer, r) for r in ["ok", "stuck", "no", "ok"]])
        elapsed = time.monotonic() - start
        assert [o.status for o in outcomes] == ["ok", "timeout", "ok", "ok"]
        assert [o.value for o in outcomes] == [1.0, None, 0.0, 1.0]
        # contained: the driver's backstop (2 x 2 s + 0.5 s) then a fresh pool, not an endless wait
        assert elapsed < 30
        assert [o.value for o in pool.run([call(scorer, "ok")] * 20)] == [1.0] * 20
    finally:
        pool.close()


def test_a_stuck_worker_is_killed_even_if_the_driver_swallows_sigterm(scorer) -> None:
    # Forked workers inherit the driver's Python signal handlers; one that ignores SIGTERM must not make
    # the pool wait forever for its stuck worker (seen in the full suite, where another library set one).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    pool = ScorerPool(ScoringConfig(timeout_s=1.0, num_workers=1))
    try:
        start = time.monotonic()
        outcomes = pool.run([call(scorer, r) for r in ["stuck", "ok"]])
        assert [o.status for o in outcomes] == ["timeout", "ok"]
        assert time.monotonic() - start < 30
    finally:
        pool.close()
        signal.signal(signal.SIGTERM, previous)


def test_in_process_mode(scorer) -> None:
    pool = ScorerPool(ScoringConfig(num_workers=0))
    outcomes = pool.run([call(scorer, "ok"), call(scorer, "raise")])
    assert [o.status for o in outcomes] == ["ok", "error"]


def test_unpicklable_function_fails_before_any_work() -> None:
    pool = ScorerPool(ScoringConfig())
    with pytest.raises(TypeError, match="cannot be sent to scorer processes"):
        pool.run([(lambda **kwargs: 1.0, {})])
    pool.close()


def test_pool_pickles_without_its_processes(scorer) -> None:
    pool = ScorerPool(ScoringConfig(timeout_s=2.0))
    pool.run([call(scorer, "ok")])
    clone = pickle.loads(pickle.dumps(pool))
    assert clone.config == pool.config
    assert clone.run([call(scorer, "ok")])[0].value == 1.0
    pool.close()
    clone.close()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ScoringConfig(timeout_s=0)
    with pytest.raises(ValueError, match="mp_context"):
        ScoringConfig(mp_context="thread")  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (reaped later by init) is not running
        return stat.read().split(")")[1].split()[0] != "Z"


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_scorer_workers_do_not_outlive_a_killed_driver(signal_name):
    script = (
        "import os\n"
        "from hybridflow.rewards.pool import ScorerPool, ScoringConfig\n"
        "from hybridflow.trainer.command import exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "pool = ScorerPool(ScoringConfig(timeout_s=60.0, num_workers=2))\n"
        "pool.run([(abs, {'x': -1})])\n"
        "print(' '.join(str(p.pid) for p in pool._pool._pool), flush=True)\n"
        "pool.run([(os.system, {'command': 'sleep 30'})] * 2)\n"  # both workers busy when the driver dies
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in driver.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    time.sleep(1.0)  # the workers are inside the 30 s call, not waiting for work
    driver.send_signal(getattr(signal, signal_name))
    code = driver.wait(timeout=30)
    assert code == (143 if signal_name == "SIGTERM" else -signal.SIGKILL)  # SIGTERM: a clean SystemExit
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


PARENT_FILE = '''
import os


def score(data_source, solution_str, ground_truth, extra_info):
    return os.getppid()
'''


def test_a_process_connected_to_ray_is_never_forked(tmp_path, ray_cluster, monkeypatch) -> None:
    """Ray does not support forking a process connected to it (a fork could leave the driver's calls to Ray's
    control store hanging): there the default 'fork' starts workers from a fork server; elsewhere they fork from
    this process."""
    from hybridflow.utils import processes

    path = tmp_path / "parent.py"
    path.write_text(PARENT_FILE)
    parent_of_worker = load_custom_reward_fn(path, "score")
    assert processes.connected_to_ray()
    pool = ScorerPool(ScoringConfig(timeout_s=30.0, num_workers=1))
    try:
        [outcome] = pool.run([call(parent_of_worker, "x")])
    finally:
        pool.close()
    assert outcome.status == "ok" and outcome.value != os.getpid()  # the fork server's child, not the driver's
    monkeypatch.setattr(processes, "connected_to_ray", lambda: False)
    pool = ScorerPool(ScoringConfig(timeout_s=30.0, num_workers=1))
    try:
        [outcome] = pool.run([call(parent_of_worker, "x")])
    finally:
        pool.close()
    assert outcome.value == os.getpid()
