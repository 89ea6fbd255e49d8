"""The Ray implementation of the single controller."""

from hybridflow.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    describe_cluster,
    node_ranks,
)
from hybridflow.single_controller.ray.colocate import create_colocated_worker_cls
from hybridflow.single_controller.ray.resource_pool_manager import ResourcePoolManager

__all__ = [
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "create_colocated_worker_cls",
    "describe_cluster",
    "node_ranks",
]
