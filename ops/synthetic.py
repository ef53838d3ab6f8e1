"""Synthetic DAG tile op: one task per DAG vertex, for scheduler tests and overhead benchmarks.

Task t computes ``out[t] = seed(t) + sum(out[d] for d in deps(t))`` (int32, wrapping), after
spinning ``work[t]`` nanoseconds; ``deps`` is CSR (``deps_ptr``, ``deps_idx``). The result of
every vertex depends on the exact values of all its ancestors, so a task that ran before one of
its dependencies wrote its value changes the output. The dependencies themselves are explicit
events (``dag_graph``), built from the host copy of the DAG, so one compiled kernel serves every
DAG with the same symbolic sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import cutlass
import torch
from cutlass import Int32, Int64, cute

from cutemk.graph import Graph
from cutemk.symbolic import Sym
from cutemk.tileop import TensorSpec, TileOp, expect_dtype, expect_ndim, register_op

SEED_MUL, SEED_ADD = 7919, 13


@register_op
@dataclass(frozen=True)
class SyntheticDagTile(TileOp):
    deps_ptr: TensorSpec  # (n + 1,) int32
    deps_idx: TensorSpec  # (m,) int32
    work: TensorSpec  # (n,) int32, nanoseconds of spinning per task
    empty: bool = False  # no body at all: measures pure scheduling overhead (out is not written)

    name: ClassVar[str] = "synthetic_dag"
    inputs: ClassVar[tuple[str, ...]] = ("deps_ptr", "deps_idx", "work")
    outputs: ClassVar[tuple[str, ...]] = ("out",)

    def __post_init__(self) -> None:
        for f in self.inputs:
            expect_ndim(getattr(self, f), 1, f"synthetic_dag {f}")
            expect_dtype(getattr(self, f), (torch.int32,), f"synthetic_dag {f}")

    def output_specs(self):
        return {"out": TensorSpec(self.work.shape, torch.int32)}

    def grid(self):
        return (self.work.shape[0],)

    def reads(self, coord, env, data=None):
        t = coord[0]
        out = {"deps_ptr": ((t, t + 2),), "work": ((t, t + 1),)}
        if data is not None:  # the exact reads, for the race checker: its dependencies' values
            lo, hi = int(data["deps_ptr"][t]), int(data["deps_ptr"][t + 1])
            out["out"] = [((d, d + 1),) for d in data["deps_idx"][lo:hi].tolist()]
        return out

    def writes(self, coord, env, data=None):
        return {"out": ((coord[0], coord[0] + 1),)}

    def cost(self, coord, env):
        return 0.3

    def reference(self, coord, env, t):
        if self.empty:
            return
        i = coord[0]
        lo, hi = int(t["deps_ptr"][i]), int(t["deps_ptr"][i + 1])
        acc = i * SEED_MUL + SEED_ADD + int(t["out"][t["deps_idx"][lo:hi].long()].long().sum())
        t["out"][i] = ((acc + 2**31) % 2**32) - 2**31

    # -- device ---------------------------------------------------------------------------------
    def device_smem_bytes(self) -> int:
        return 0

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        mPtr, mIdx, mWork, mOut = tensors[0], tensors[1], tensors[2], tensors[3]
        if cutlass.const_expr(not self.empty):
            if tidx == 0:
                acc = coord0 * SEED_MUL + SEED_ADD
                for j in range(mPtr[coord0], mPtr[coord0 + 1]):
                    acc = acc + mOut[mIdx[j]]
                spin = Int64(mWork[coord0])
                if spin > 0:
                    t0 = cute.arch.globaltimer()
                    while cute.arch.globaltimer() - t0 < spin:
                        pass
                mOut[coord0] = acc


def synthetic_dag(
    deps_ptr: TensorSpec, deps_idx: TensorSpec, work: TensorSpec, *, empty: bool = False
) -> SyntheticDagTile:
    return SyntheticDagTile(deps_ptr, deps_idx, work, empty)


def dag_graph(
    deps: Sequence[Sequence[int]], n: Sym, m: Sym, name: str = "dag", empty: bool = False
) -> Graph:
    """A graph running one synthetic task per vertex of ``deps`` (vertex -> its dependencies).

    Leaves: deps_ptr (n+1,), deps_idx (m,), work (n,); see :func:`dag_inputs`.
    """
    g = Graph(name)
    ptr = g.input("deps_ptr", (n + 1,), torch.int32)
    idx = g.input("deps_idx", (m,), torch.int32)
    work = g.input("work", (n,), torch.int32)
    out = g.call(synthetic_dag, ptr, idx, work, empty=empty)
    deps = [tuple(int(d) for d in ds) for ds in deps]
    g.event(
        (n,),
        name="vertex",
        notify=[(out, lambda t: (t,))],
        wait=[(out, lambda t: [(d,) for d in deps[t]])],
    )
    g.output(out, "out")
    return g


def dag_inputs(
    deps: Sequence[Sequence[int]], work_ns: Sequence[int] | int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = len(deps)
    ptr = torch.zeros(n + 1, dtype=torch.int32)
    ptr[1:] = torch.cumsum(torch.tensor([len(d) for d in deps]), 0)
    flat = [d for ds in deps for d in ds] or [0]  # m >= 1: a sym's minimum
    work = (
        torch.full((n,), work_ns, dtype=torch.int32)
        if isinstance(work_ns, int)
        else torch.tensor(list(work_ns), dtype=torch.int32)
    )
    return ptr.to(device), torch.tensor(flat, dtype=torch.int32, device=device), work.to(device)
