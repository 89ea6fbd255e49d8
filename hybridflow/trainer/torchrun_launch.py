"""verl's SFT lines start under torchrun (`torchrun --nproc_per_node=N -m verl.trainer.fsdp_sft_trainer ...`): N
processes, each one rank. hybridflow's driver is one process that starts its N workers on Ray. Under torchrun,
rank 0 becomes that driver, with torchrun's layout as its worker count, and the other ranks exit at once (torchrun
then reports rank 0's exit status).

    launch = torchrun_launch(os.environ)          # None outside torchrun
    overrides = driver_overrides(launch, overrides)  # trainer.n_gpus_per_node=N, or a ValueError naming the key
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

__all__ = ["TORCHRUN_VARIABLES", "TorchrunLaunch", "clear_torchrun_environment", "driver_overrides", "torchrun_launch"]

TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)
"""What torchrun sets in each process it starts: its own group's layout and rendezvous, not the workers'."""


@dataclass(frozen=True)
class TorchrunLaunch:
    """This process's place in the group torchrun started."""

    rank: int
    world_size: int
    local_world_size: int

    @property
    def nnodes(self) -> int:
        """Nodes torchrun started processes on."""
        return self.world_size // self.local_world_size


def torchrun_launch(environ: Mapping[str, str]) -> TorchrunLaunch | None:
    """The torchrun group this process belongs to, read from `environ`; None when torchrun did not start it."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    world_size = int(environ.get("WORLD_SIZE", "1"))
    return TorchrunLaunch(rank=int(environ.get("RANK", "0")), world_size=world_size,
                          local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world_size))))


def driver_overrides(launch: TorchrunLaunch, overrides: Sequence[str]) -> list[str]:
    """`overrides` with the worker layout torchrun asked for (`trainer.nnodes=1`,
    `trainer.n_gpus_per_node=<nproc_per_node>`) where the line does not set it.

    Raises:
        ValueError: torchrun spans several nodes (the driver places workers through a Ray cluster instead), or the
            line sets a layout key to another value than torchrun's (verl would follow torchrun and ignore it).
    """
    if launch.nnodes > 1:
        raise ValueError(
            f"torchrun started {launch.nnodes} nodes x {launch.local_world_size} processes: hybridflow's SFT driver "
            "places its workers through Ray. Start a Ray cluster on the nodes and run this line once, with python "
            f"instead of torchrun, RAY_ADDRESS set, trainer.nnodes={launch.nnodes} and "
            f"trainer.n_gpus_per_node={launch.local_world_size}"
        )
    wanted = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": launch.local_world_size}
    result = list(overrides)
    for key, value in wanted.items():
        written = [item.split("=", 1)[1] for item in overrides if item.lstrip("+").split("=", 1)[0] == key]
        if not written:
            result.append(f"{key}={value}")
        elif written[-1].strip() != str(value):
            raise ValueError(
                f"{key}={written[-1]} but torchrun started {launch.world_size} processes "
                f"({launch.nnodes} node x {launch.local_world_size}): under torchrun the worker layout is torchrun's; "
                f"drop {key} or set it to {value}"
            )
    return result


def clear_torchrun_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Drop torchrun's variables from the driver's environment, so the Ray cluster it starts (and its workers,
    which get their own ranks and rendezvous) does not inherit the launcher's group."""
    for name in TORCHRUN_VARIABLES:
        environ.pop(name, None)
