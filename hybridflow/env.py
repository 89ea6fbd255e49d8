"""Every environment variable hybridflow reads, in one place, each behind a small function."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and other caches live: `$HYBRIDFLOW_CACHE` or `~/.cache/hybridflow`."""
    return Path(os.environ.get("HYBRIDFLOW_CACHE", Path.home() / ".cache" / "hybridflow"))


def sandbox_namespaces_unavailable() -> bool:
    """`HYBRIDFLOW_SANDBOX_NO_NAMESPACES=1` says this machine cannot give the sandbox user namespaces: the tests
    of the default isolation then skip instead of failing (`hybridflow doctor` shows what the machine gives)."""
    return os.environ.get("HYBRIDFLOW_SANDBOX_NO_NAMESPACES", "") == "1"


def dist_rank() -> int:
    """Global rank of this SPMD worker (`RANK`, set by the worker group)."""
    return int(os.environ.get("RANK", "0"))


def dist_world_size() -> int:
    """Number of ranks in this worker group (`WORLD_SIZE`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def dist_local_rank() -> int:
    """Rank of this worker on its node (`LOCAL_RANK`)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def dist_local_world_size() -> int:
    """Ranks of this worker group on this worker's node (`LOCAL_WORLD_SIZE`, as torchrun sets it); 1 if unset."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def dist_master_addr() -> str | None:
    """Address of rank 0's rendezvous (`MASTER_ADDR`), if set and non-empty."""
    return os.environ.get("MASTER_ADDR") or None


def dist_master_port() -> str | None:
    """Port of rank 0's rendezvous (`MASTER_PORT`), if set and non-empty."""
    return os.environ.get("MASTER_PORT") or None


def ray_address() -> str | None:
    """An existing Ray cluster to join (`RAY_ADDRESS`); None starts the embedded local cluster."""
    return os.environ.get("RAY_ADDRESS") or None


def set_dist_env(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: str) -> None:
    """Export the torch.distributed rendezvous variables for `init_process_group(init_method='env://')`."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )


def local_mode() -> bool:
    """True when workers run inside the driver process (`HYBRIDFLOW_LOCAL_MODE=1`), without Ray."""
    return os.environ.get("HYBRIDFLOW_LOCAL_MODE", "0") == "1"


def set_local_mode(enabled: bool) -> None:
    """Mark this process as running workers in local mode."""
    os.environ["HYBRIDFLOW_LOCAL_MODE"] = "1" if enabled else "0"


def mlflow_tracking_uri() -> str | None:
    """An MLflow server or store chosen by the user (`MLFLOW_TRACKING_URI`); None logs to the run directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def wandb_mode() -> str | None:
    """The Weights & Biases mode the user chose (`WANDB_MODE`: online, offline, disabled); None when unset."""
    return os.environ.get("WANDB_MODE") or None


def wandb_has_credentials() -> bool:
    """Whether an API key for Weights & Biases is at hand: `WANDB_API_KEY`, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        entries = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return base_url.split("://")[-1].split("/")[0] in entries


@contextmanager
def scoped_environ() -> Iterator[None]:
    """Restore the process environment as it was when the block ends."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
