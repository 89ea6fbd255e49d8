"""The test session's fork server (one per process in multiprocessing): what it imports once.

Two-rank tests fork their ranks from it (`tests.engines.helpers.run_distributed`), and a process connected to Ray
starts scorer workers from it too (`hybridflow.utils.processes`); both add their modules to its preload list, so
whichever starts it first, it imports both. Torch-free: conftest adds them without importing torch."""

from __future__ import annotations

from hybridflow.utils.processes import add_fork_server_preload

RANK_PRELOAD = ["torch", "torch.distributed", "transformers", "hybridflow.engines.training",
                "hybridflow.engines.rollout", "hybridflow.models", "tests.engines.helpers"]
"""What the fork server imports once per test session. A spawned rank imports torch, transformers and the engines
itself (about 9 s on a 2-core host, two ranks at once); a rank forked from the server starts with them loaded."""


def use_rank_preload() -> None:
    """Have the fork server, when it starts, import `RANK_PRELOAD` too (no effect once it runs)."""
    add_fork_server_preload(RANK_PRELOAD)
