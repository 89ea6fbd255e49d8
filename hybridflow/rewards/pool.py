"""Running scorers in worker processes with a per-call timeout, so a raising or hung scorer costs one sample.

`ScorerPool.run(calls)` submits every call at once to a persistent `multiprocessing.Pool` of `num_workers`
processes, which run them in parallel, and collects the results in order. A call that raises gives an `error` outcome (its traceback is logged once per pool).
Timeouts have two layers:
- in the worker, a SIGALRM timer interrupts a call after `timeout_s` (a Python-level hang such as a
  `while True` loop): `timeout` outcome, and the worker goes on with the next call;
- in the driver, a backstop for hangs the alarm cannot break (C code, a scorer that masks the signal): a
  call still unfinished `2 * timeout_s + 0.5` s after every call before it finished gives a `timeout`
  outcome, the pool is terminated (killing the stuck worker) and the unfinished calls go to a fresh pool.
  Work is queued in submission order, so when the driver starts waiting on a call it is already running;
  waiting from then never cuts a call short.
A scorer with a `prepare()` method (a custom reward file: its import) is prepared in every worker when the pool
starts, and the driver waits up to `_PREPARE_WAIT_S` for that before it submits calls, so a slow import (a reward
file importing torch on a loaded machine) is not charged to the first calls' timeouts. A new such scorer starts a
fresh pool.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import multiprocessing
import multiprocessing.pool
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.rewards.score.code import DEFAULT_LIMITS
from hybridflow.sandbox import SandboxLimits
from hybridflow.utils.processes import add_fork_server_preload, start_method

__all__ = ["ScoreOutcome", "ScorerPool", "ScoringConfig"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # prctl option: signal this process when its parent dies
_PREPARE_WAIT_S = 120.0
"""How long a fresh pool's workers may take to prepare the scorers (import the user's reward file)."""


def scorer_preload() -> list[str]:
    """Modules a fork server imports once, so that its workers start with the scorers loaded: the built-in scorers,
    and reasoning-gym's verifiers where installed (about 1 s to import in each worker otherwise)."""
    return ["hybridflow.rewards.score"] + (["reasoning_gym"] if importlib.util.find_spec("reasoning_gym") else [])


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """Where and how long reward scorers run."""

    timeout_s: float = 10.0
    """Seconds one scorer call may run; past that it scores 0 and counts in `reward/timeouts`."""

    num_workers: int = 8
    """Scorer processes, each running one call at a time: up to this many hung calls cost one `timeout_s` together,
    not one after another. Workers fork from the driver (copy-on-write), so idle ones cost little memory (from a
    fork server where the driver is connected to Ray, see mp_context). 0 runs scorers in the calling process: no
    isolation and no timeout (debugging)."""

    mp_context: Literal["fork", "forkserver", "spawn"] = "fork"
    """How worker processes start. 'fork' (default) starts in milliseconds and sees every function and
    scorer registered in the driver; workers only run pure-Python scorers, never torch or Ray code. A process
    connected to Ray (a run's driver, a Ray worker) is never forked: Ray does not support it, and a fork can
    leave the parent's calls to Ray's control store hanging; there 'fork' starts the workers from a fork server
    (a clean interpreter with the scorers imported), as 'forkserver' does. 'forkserver'/'spawn' start clean
    interpreters, which re-import the driver's main script: what it runs must sit under
    `if __name__ == "__main__":` (the CLI's does; a script without that block is refused, named), and scorers it
    registers at run time are registered there again."""

    max_error_fraction: float = 0.9
    """A batch in which more than this share of scorer calls fails stops the run, naming the data sources: that
    is a wrong scorer or ground-truth format, not a bad sample. 1.0 never stops."""

    sandbox: SandboxLimits = field(default_factory=lambda: DEFAULT_LIMITS)
    """Sandbox of the scorers that run model-written code (`code`, `openai_humaneval`): time, memory, disk and
    `isolation` ('namespaces', required by default; 'none' only where the machine has no user namespaces and
    you accept running the code with rlimits and an audit hook only). Keep `wall_time_s` below `timeout_s`, so
    the sandbox stops a slow program itself (status 'timeout') before the pool cuts the scorer off."""

    def __post_init__(self) -> None:
        if not 0.0 < self.max_error_fraction <= 1.0:
            raise ValueError(f"max_error_fraction must be in (0, 1], got {self.max_error_fraction}")
        if self.timeout_s <= 0:
            raise ValueError(f"reward scoring timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"reward scoring num_workers must be >= 0, got {self.num_workers}")
        if self.mp_context not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"reward scoring mp_context must be 'fork', 'forkserver' or 'spawn', "
                             f"got {self.mp_context!r}")


@dataclass(frozen=True)
class ScoreOutcome:
    """One call's result: status 'ok' with `value`, or 'error'/'timeout' with a `message`."""

    status: Literal["ok", "error", "timeout"]
    value: Any = None
    message: str = ""


class _ScorerTimeout(BaseException):
    """Raised inside a scorer by the worker's alarm; a BaseException so `except Exception` cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ScorerTimeout


def _start_worker(die_with_parent: bool, scorers: list[Any], prepared: Any) -> None:
    """A worker's start: default signal handlers, then every scorer prepared (a failure is left for its calls to
    report as their error), counted in the shared `prepared`."""
    _reset_signal_handlers(die_with_parent)
    for scorer in scorers:
        try:
            scorer.prepare()
        except BaseException:  # noqa: BLE001 - reported by the calls, which prepare again
            pass
    with prepared.get_lock():
        prepared.value += 1


def _preparable(calls: Sequence[tuple[Callable[..., Any], dict[str, Any]]]) -> dict[Any, Any]:
    """The calls' scorers with a `prepare()`, keyed by what they load: a reward file's (path, function name), so
    equal callers built per step count once; any other scorer by its identity."""
    found = {}
    for fn, _ in calls:
        if callable(getattr(fn, "prepare", None)):
            path = getattr(fn, "path", None)
            found[(path, getattr(fn, "name", None)) if path is not None else id(fn)] = fn
    return found


def _reset_signal_handlers(die_with_parent: bool = False) -> None:
    """Default SIGTERM/SIGINT in a worker: a forked worker inherits the driver's Python handlers (test runners,
    Ray and torch install some), and one that swallows SIGTERM would make `Pool.terminate()` wait forever on a
    stuck scorer. With `die_with_parent` (Linux), the worker is killed when the process that started it dies,
    even by SIGKILL, instead of lingering as an orphan."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if die_with_parent and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _call(fn: Callable[..., Any], kwargs: dict[str, Any], alarm_s: float | None) -> ScoreOutcome:
    """Runs in a worker: the scorer's result, its traceback (a failing scorer must not kill the batch), or a
    timeout after `alarm_s` seconds (None: no alarm, for calls in the driver process)."""
    prepare = getattr(fn, "prepare", None)
    if callable(prepare):  # a first call's import of the user's file is not the scorer's time
        try:
            prepare()
        except (Exception, SystemExit):
            return ScoreOutcome("error", message=traceback.format_exc())
    if alarm_s is not None:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, alarm_s)
    try:
        return ScoreOutcome("ok", fn(**kwargs))
    except _ScorerTimeout:
        return ScoreOutcome("timeout", message=f"scorer ran past {alarm_s} s")
    except (Exception, SystemExit):  # any scorer failure is reported to the driver and counted there
        return ScoreOutcome("error", message=traceback.format_exc())
    finally:
        if alarm_s is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)


class ScorerPool:
    """A persistent pool of scorer processes; see the module docstring for the timeout rule.

    Picklable (the pool itself is not sent), so a reward manager holding one can be shipped to Ray tasks.
    """

    def __init__(self, config: ScoringConfig, counted_in: str = "reward/errors and reward/timeouts") -> None:
        """`counted_in`: the metrics the caller counts failed calls in, named in the first failure's warning."""
        self.config = config
        self.counted_in = counted_in
        self._pool: multiprocessing.pool.Pool | None = None
        self._finalizer: weakref.finalize | None = None
        self._prepared: dict[Any, Any] = {}  # scorers the workers prepare when they start
        self._logged_error = False
        self._logged_timeout = False
        if config.num_workers == 0:
            logger.warning("reward scorers run in the driver process (num_workers=0): no timeout, no isolation")

    def run(self, calls: Sequence[tuple[Callable[..., Any], dict[str, Any]]]) -> list[ScoreOutcome]:
        """`[fn(**kwargs) for fn, kwargs in calls]` as outcomes, in order; never raises for a scorer's fault.

        Raises:
            TypeError: a function cannot be pickled to the worker processes (checked before any work).
        """
        if self.config.num_workers == 0:
            return self._log_first([_call(fn, kwargs, None) for fn, kwargs in calls])
        for fn in {id(fn): fn for fn, _ in calls}.values():
            _check_picklable(fn)
        outcomes: list[ScoreOutcome | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        preparable = _preparable(calls)
        if self._pool is not None and not preparable.keys() <= self._prepared.keys():
            self._terminate()  # a scorer the workers have not prepared: start them again with it
        self._prepared.update(preparable)
        while pending:
            pool = self._ensure_pool()
            handles = [(i, pool.apply_async(_call, (*calls[i], self.config.timeout_s))) for i in pending]
            pending = []
            for position, (i, handle) in enumerate(handles):
                try:
                    outcomes[i] = handle.get(timeout=2 * self.config.timeout_s + 0.5)
                except multiprocessing.TimeoutError:
                    outcomes[i] = ScoreOutcome("timeout", message=f"scorer stuck past {self.config.timeout_s} s")
                    for j, later in handles[position + 1:]:
                        if later.ready():
                            outcomes[j] = _get_ready(later)
                        else:
                            pending.append(j)
                    self._terminate()  # kills the stuck worker; the unfinished calls go to a fresh pool
                    break
                except Exception as err:  # a result the pool could not pickle, or a pickling failure
                    outcomes[i] = ScoreOutcome("error", message=f"{type(err).__name__}: {err}")
        return self._log_first(outcomes)

    def _log_first(self, outcomes: list[ScoreOutcome]) -> list[ScoreOutcome]:
        for outcome in outcomes:
            if outcome.status == "error" and not self._logged_error:
                self._logged_error = True
                logger.warning("a reward scorer raised; it scores 0 (counted in %s). First error:\n%s", self.counted_in,
                               outcome.message)
            if outcome.status == "timeout" and not self._logged_timeout:
                self._logged_timeout = True
                logger.warning("a reward scorer ran past %s s; it scores 0 (counted in %s)", self.config.timeout_s,
                               self.counted_in)
        return outcomes

    def _ensure_pool(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            method = start_method(self.config.mp_context, "the reward scorer processes")  # Ray's are not forked
            context = multiprocessing.get_context(method)
            if method == "forkserver":
                add_fork_server_preload(scorer_preload())
            # The death signal follows the thread that started the worker: ask for it only from the main thread,
            # which lives as long as the process.
            in_main_thread = threading.current_thread() is threading.main_thread()
            prepared = context.Value("i", 0)
            self._pool = context.Pool(
                processes=self.config.num_workers, initializer=_start_worker,
                initargs=(in_main_thread, list(self._prepared.values()), prepared),
            )
            self._finalizer = weakref.finalize(self, self._pool.terminate)
            if self._prepared:
                self._wait_prepared(prepared)
        return self._pool

    def _wait_prepared(self, prepared: Any) -> None:
        """Wait until every worker has prepared the scorers (at most `_PREPARE_WAIT_S`; past it, the calls' own
        timeouts apply and a warning says why they may time out)."""
        deadline = time.monotonic() + _PREPARE_WAIT_S
        while prepared.value < self.config.num_workers and time.monotonic() < deadline:
            time.sleep(0.01)
        if prepared.value < self.config.num_workers:
            logger.warning("the reward scorer processes did not finish importing the reward function within %.0f s; "
                           "their first calls may time out", _PREPARE_WAIT_S)

    def _terminate(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs pool.terminate() once
        self._pool = None
        self._finalizer = None

    def close(self) -> None:
        """Stop the worker processes (a later `run` starts new ones)."""
        self._terminate()

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "counted_in": self.counted_in}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], state["counted_in"])


def _get_ready(handle: multiprocessing.pool.AsyncResult) -> ScoreOutcome:
    try:
        return handle.get(timeout=0)
    except Exception as err:  # see ScorerPool.run: reported as this call's error
        return ScoreOutcome("error", message=f"{type(err).__name__}: {err}")


def _check_picklable(fn: Callable[..., Any]) -> None:
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(
            f"reward function {fn!r} cannot be sent to scorer processes ({err}); use a module-level function, "
            "functools.partial of one, or hybridflow.rewards.load_custom_reward_fn(path, name)"
        ) from err
