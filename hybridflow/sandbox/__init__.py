"""Running untrusted code (model-written programs for code rewards and the code-interpreter tool) in a
separate, throwaway, resource-limited process with no network.

    from hybridflow.sandbox import SandboxLimits, run_python
    result = run_python("print(input()[::-1])", stdin="abc", limits=SandboxLimits(wall_time_s=3))
    result.status, result.stdout, result.isolation_mode   # ('ok', 'cba\\n', 'namespaces')

Layers (see `_child.py`, `_runtime.py`, `_harness.py` and `_cgroup.py` for what each guarantees and what it
does not):
- a separate interpreter (`-I -S`), clean environment, fresh working directory deleted afterwards;
- rlimits: CPU, address space, file size, open files, core dumps, processes; trainer-side wall-time and
  output caps that kill the whole process group; a process-wide limit on sandboxes running at once;
- Linux namespaces, required by default (`SandboxLimits.isolation='namespaces'`; without them every run
  raises `SandboxError` naming the setting, never a silent fallback): private user (uid `nobody` for a root
  trainer), network (no interfaces), pid, ipc, uts and mount namespaces, a read-only minimal root with only
  the working directory writable (a tmpfs of `disk_mb`), no capabilities, no_new_privs;
- where the kernel lets the trainer create one, a memory cgroup capping the whole sandbox;
- always: an audit hook in the child that stops forbidden actions early with status 'blocked' (a tripwire,
  not a boundary: see `_runtime.py`);
- for code with tests (`run_python(..., tests=...)`): the tests run in a separate harness process that
  decides the verdict, out of the program's reach.
"""

from hybridflow.sandbox._cgroup import describe_cgroup_support
from hybridflow.sandbox.limits import (
    HarnessVerdict, IsolationMode, SandboxError, SandboxLimits, SandboxResult, SandboxStatus)
from hybridflow.sandbox.runner import max_concurrent_runs, run_python, run_python_async, set_max_concurrent_runs

__all__ = ["HarnessVerdict", "IsolationMode", "SandboxError", "SandboxLimits", "SandboxResult", "SandboxStatus",
           "describe_cgroup_support", "max_concurrent_runs", "run_python", "run_python_async",
           "set_max_concurrent_runs"]
