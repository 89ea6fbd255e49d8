"""Maps roles (actor_rollout, critic, ref, reward) to resource pools: colocated or split placement."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.single_controller.ray.base import RayResourcePool


@dataclass
class ResourcePoolManager:
    """`resource_pool_spec`: pool name -> processes per node; `mapping`: role -> pool name."""

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[str, str]
    use_gpu: bool = False
    num_cpus_per_worker: float = 1.0
    max_colocate_count: int = 1
    pools: dict[str, RayResourcePool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = {role: pool for role, pool in self.mapping.items() if pool not in self.resource_pool_spec}
        if unknown:
            raise ValueError(f"roles map to undefined pools {unknown}; defined: {sorted(self.resource_pool_spec)}")

    def create_resource_pools(self) -> None:
        """Build every pool (placement groups are created when a worker group first asks)."""
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.pools[name] = RayResourcePool(
                process_on_nodes,
                use_gpu=self.use_gpu,
                max_colocate_count=self.max_colocate_count,
                num_cpus_per_worker=self.num_cpus_per_worker,
                name_prefix=name,
            )

    def get_resource_pool(self, role: str) -> RayResourcePool:
        """The pool that hosts `role`."""
        if role not in self.mapping:
            raise KeyError(f"role {role!r} has no resource pool; mapped roles: {sorted(self.mapping)}")
        if not self.pools:
            self.create_resource_pools()
        return self.pools[self.mapping[role]]

    def roles_by_pool(self) -> dict[str, list[str]]:
        """Pool name -> the roles placed in it (roles in one pool share processes)."""
        grouped: dict[str, list[str]] = {}
        for role, pool in self.mapping.items():
            grouped.setdefault(pool, []).append(role)
        return grouped
