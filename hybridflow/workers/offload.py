"""`optimizer_on_device`: the optimizer offload (`fsdp_config.optimizer_offload`) around a training engine's update,
shared by every worker that trains one (actor, critic, SFT, PRIME's implicit PRM)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def optimizer_on_device(engine: Any, optimizer_offload: bool) -> Iterator[None]:
    """Run the block (an update) with `engine`'s optimizer state on its device; with `optimizer_offload` the state
    comes from the host before the block and goes back after it (also when the block raises), so it waits off the
    accelerator between updates. Only the optimizer state moves: the parameters stay where they are, and with
    `param_offload` the engine keeps the state beside the host shards, where the step runs. On CPU both moves are
    no-ops (`FSDPEngine.offload_to_cpu`)."""
    if not optimizer_offload:
        yield
        return
    engine.load_to_device(model=False, optimizer=True)
    try:
        yield
    finally:
        engine.offload_to_cpu(model=False, optimizer=True)
