"""Ranks and symmetric memory for distributed graphs (tensor-parallel layers across GPUs).

Every rank runs the same graph in its own process (``torchrun``, one GPU each) and its own
megakernel. Buffers that other ranks read or write (an op's ``peer_values``, and the kernel's
event counters) are allocated in **symmetric memory** through PyTorch
(``torch.distributed._symmetric_memory``: the same size on every rank, each rank's copy mapped
into every GPU's address space over NVLink). Device code reaches a peer's copy through a *peer
table*, an int64 tensor ``[rank, addr_0, ..., addr_{W-1}]``.

With no process group the same code runs on plain allocations (one rank), so the whole
distributed path (peer tables, system-scope events, the per-launch rank barrier) is exercised on
one GPU; a process group of one rank goes through symmetric memory as a larger one does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def plan_digest(plan: Any) -> int:
    """What every rank's plan must agree on (a 56-bit hash): a cross-rank wait names an event
    by id in the other rank's plan, so all ranks must have bound the same dims (but their
    rank) and numbered the events they share the same way."""
    import hashlib

    env = {k: v for k, v in plan.env.items() if k != "RANK"}
    shared = [(e, plan.event_label[e], plan.event_count[e]) for e in sorted(plan.shared_events)]
    # every value's concrete shape and dtype: ranks whose graphs differ in a fixed width or a
    # dtype bind the same dims but would read each other's buffers wrongly
    values = [(v.name, plan.shapes[v.name], str(v.dtype)) for v in plan.graph.values]
    digest = hashlib.sha256(repr((sorted(env.items()), shared, values)).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def different_plans_error(rank: Any, env: dict) -> str:
    env = {k: v for k, v in env.items() if k != "RANK"}
    return (
        f"rank {rank}: the ranks built different plans (dims {env}); every rank must call "
        "the graph with the same shapes, in the same order"
    )


@dataclass(frozen=True)
class Communicator:
    """This process's place in the world: ``rank`` of ``world``, and the process group."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @staticmethod
    def from_group(group: Any = None) -> Communicator:
        """The default process group's (or ``group``'s) rank and size; rank 0 of 1 without one."""
        import torch.distributed as dist

        if group is None and not (dist.is_available() and dist.is_initialized()):
            return Communicator()
        if group is None:
            group = dist.group.WORLD
        return Communicator(dist.get_rank(group), dist.get_world_size(group), group)

    def env(self) -> dict[str, int]:
        """Bindings every distributed plan sees: ``RANK`` and ``WORLD``."""
        return {"RANK": self.rank, "WORLD": self.world}

    def max_over_ranks(self, n: int) -> int:
        if self.world == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def same_on_all_ranks(self, value: int) -> bool:
        """Do all ranks pass the same (non-negative, < 2**62) ``value``? Collective."""
        if self.world == 1 or self.group is None:
            return True
        import torch.distributed as dist

        t = torch.tensor([value, -value], dtype=torch.int64, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]) == value and int(t[1]) == -value

    def symmetric_empty(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        """A flat buffer of at least ``numel`` elements on every rank (collective call: sizes are
        agreed on first), and the address of each rank's copy as seen from this GPU."""
        numel = self.max_over_ranks(max(int(numel), 1))
        if self.group is None:  # no process group: one rank, plain memory
            t = torch.empty(numel, dtype=dtype, device="cuda")
            return t, [t.data_ptr()]
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(numel, dtype=dtype, device="cuda")
        handle = symm_mem.rendezvous(t, self.group)
        ptrs = [handle.get_buffer(r, (numel,), dtype).data_ptr() for r in range(self.world)]
        return t, ptrs

    def peer_table(self, ptrs: list[int]) -> torch.Tensor:
        """The device-side table ``[rank, addr_0, ..., addr_{W-1}]`` (int64, on this GPU)."""
        return torch.tensor([self.rank, *ptrs], dtype=torch.int64, device="cuda")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)


@dataclass
class PeerTable:
    """Host-side (reference / interpreter) twin of a device peer table: this rank and every
    rank's copy of a symmetric value."""

    rank: int
    tensors: list[torch.Tensor]

    @property
    def world(self) -> int:
        return len(self.tensors)


def symmetric_values(graph: Any) -> list[str]:
    """Names of the values some op of ``graph`` reaches on other ranks (``TileOp.peer_values``),
    in first-use order: they live in symmetric memory and get a peer table each."""
    names: list[str] = []
    for node in graph.nodes:
        for a in node.op.peer_values:
            v = node.args.get(a) or node.results[a]
            if v.name not in names:
                names.append(v.name)
    return names


def is_distributed(graph: Any) -> bool:
    """Does ``graph`` reach other ranks (peer values or cross-rank waits)?"""
    return bool(symmetric_values(graph)) or any(em.remote_wait for em in graph.event_maps)


def peer_key(value_name: str) -> str:
    """Name under which an op's reference finds the peer table of ``value_name``."""
    return f"{value_name}@peers"
