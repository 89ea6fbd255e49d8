"""Running untrusted code (model-written programs for code rewards and the code-interpreter tool) in a
separate, throwaway, resource-limited process with no network.

    from hybridflow.sandbox import SandboxLimits, run_python
    result = run_python("print(input()[::-1])", stdin="abc", limits=SandboxLimits(wall_time_s=3))
    result.status, result.stdout   # ('ok', 'cba\\n')

Layers (see `_child.py` and `_runtime.py` for what each guarantees and what it does not):
- a separate interpreter (`-I -S`), clean environment, fresh working directory deleted afterwards;
- rlimits: CPU, address space, file size, open files, core dumps, processes; trainer-side wall-time and
  output caps that kill the whole process group;
- where the kernel allows unprivileged user namespaces: private user (uid `nobody` for a root trainer),
  network (no interfaces), pid, ipc, uts and mount namespaces, a read-only minimal root with only the
  working directory writable, no capabilities, no_new_privs;
- always: an audit hook in the child that stops forbidden actions early with status 'blocked' (a tripwire,
  not a boundary: see `_runtime.py`).
"""

from hybridflow.sandbox.limits import SandboxError, SandboxLimits, SandboxResult, SandboxStatus
from hybridflow.sandbox.runner import run_python, run_python_async

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "SandboxStatus", "run_python", "run_python_async"]
