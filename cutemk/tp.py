"""Tensor-parallel layer graphs: GEMM + reduce-scatter and all-gather + GEMM in one megakernel.

Every rank builds the same graph; ``RANK`` and ``WORLD`` are bound at launch (see
``cutemk.comm``). The cross-rank dependencies are explicit event tensors with ``remote_wait``
maps, tile to tile:

- **GEMM + RS** (row-parallel linear, e.g. the MLP's down projection): each rank multiplies its
  K-slice, ``partial = a @ w^T`` (m, n), into symmetric memory; the reduce-scatter tile for
  rows ``[rank*m/W + ...]`` waits for the GEMM tiles covering its block *on every rank*, so it
  starts while the rest of the GEMM still runs.
- **AG + GEMM** (column-parallel linear fed by sequence-sharded activations): each rank pushes
  its shard of rows into every rank's ``gathered``; a GEMM tile waits only for the copy tiles
  of the shard it reads, on the rank that owns it.

This module sits above the core, beside ``cutemk.layers``.
"""

from __future__ import annotations

from typing import Any

import torch

from cutemk import ops
from cutemk.graph import Graph
from cutemk.symbolic import Sym, cdiv
from cutemk.tileop import expect_positive_sizes


def _span(lo: int, hi: int, size: int) -> range:
    """Block indices of blocks of ``size`` that overlap ``[lo, hi)``."""
    return range(lo // size, (hi - 1) // size + 1) if hi > lo else range(0)


def _check_tp(tokens: Any, name: str, **sizes: Any) -> None:
    """The token dim is a sym (its value is read from the plan's dims) and every size a
    positive int: 0 was taken for a block and replaced by the default, or ran empty."""
    if not isinstance(tokens, Sym):
        raise TypeError(f"{name} must be a sym (cutemk.sym), got {tokens!r}")
    expect_positive_sizes(**sizes)


def gemm_rs_graph(
    tokens: Sym,
    k_shard: int,
    n: int,
    world: int,
    dtype: torch.dtype = torch.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    rs_block_m: int | None = None,
    rs_block_n: int | None = None,
) -> Graph:
    """``out = reduce_scatter(a @ w^T)``: leaves ``a`` (tokens, k_shard), ``w`` (n, k_shard);
    output ``out`` (tokens / world, n), this rank's rows of the sum over ranks."""
    _check_tp(tokens, "tokens", k_shard=k_shard, n=n, world=world, block_m=block_m, block_n=block_n)
    rs_bm = block_m if rs_block_m is None else rs_block_m
    rs_bn = block_n if rs_block_n is None else rs_block_n
    expect_positive_sizes(rs_block_m=rs_bm, rs_block_n=rs_bn)
    g = Graph(f"gemm_rs_w{world}")
    a = g.input("a", (tokens, k_shard), dtype)
    w = g.weight("w", (n, k_shard), dtype)
    partial = g.call(ops.gemm, a, w, block_m=block_m, block_n=block_n)
    out = g.call(ops.reduce_scatter, partial, world=world, block_m=rs_bm, block_n=rs_bn)

    def producers(i, j, env):
        chunk = env[tokens.name] // world
        base = env.get("RANK", 0) * chunk
        r0, r1 = base + i * rs_bm, base + min((i + 1) * rs_bm, chunk)
        c0, c1 = j * rs_bn, min((j + 1) * rs_bn, n)
        tiles = [(gi, gj) for gi in _span(r0, r1, block_m) for gj in _span(c0, c1, block_n)]
        return [(r, t) for r in range(world) for t in tiles]

    g.event(
        (cdiv(tokens, block_m), cdiv(n, block_n)),
        name="gemm_done",
        notify=[(partial, lambda i, j: (i, j))],
        remote_wait=[(out, producers)],
    )
    g.output(out, "out")
    return g


def ag_gemm_graph(
    shard_tokens: Sym,
    k: int,
    n_shard: int,
    world: int,
    dtype: torch.dtype = torch.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    ag_block_m: int = 64,
    ag_block_n: int | None = None,
) -> Graph:
    """``y = all_gather(x) @ w^T``: leaves ``x`` (shard_tokens, k), this rank's rows, and ``w``
    (n_shard, k); output ``y`` (shard_tokens * world, n_shard)."""
    _check_tp(
        shard_tokens,
        "shard_tokens",
        k=k,
        n_shard=n_shard,
        world=world,
        block_m=block_m,
        block_n=block_n,
        ag_block_m=ag_block_m,
    )
    ag_bn = k if ag_block_n is None else ag_block_n
    expect_positive_sizes(ag_block_n=ag_bn)
    g = Graph(f"ag_gemm_w{world}")
    x = g.input("x", (shard_tokens, k), dtype)
    w = g.weight("w", (n_shard, k), dtype)
    gathered = g.call(ops.all_gather, x, world=world, block_m=ag_block_m, block_n=ag_bn)
    y = g.call(ops.gemm, gathered, w, block_m=block_m, block_n=block_n)
    k_blocks = range(-(-k // ag_bn))

    def copies(i, j, env):
        s = env[shard_tokens.name]
        lo, hi = i * block_m, min((i + 1) * block_m, s * world)
        out = []
        for r in _span(lo, hi, s):  # shards this row tile reads
            a, b = max(lo, r * s) - r * s, min(hi, (r + 1) * s) - r * s
            out += [(r, (ai, ak)) for ai in _span(a, b, ag_block_m) for ak in k_blocks]
        return out

    g.event(
        (cdiv(shard_tokens, ag_block_m), len(k_blocks)),
        name="shard_copied",
        notify=[(gathered, lambda i, j: (i, j))],
        remote_wait=[(y, copies)],
    )
    g.output(y, "y")
    return g


# -- references (fp32, all ranks' inputs in one process) ---------------------------------------
def gemm_rs_reference(a: list[torch.Tensor], w: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per rank r: rows ``[r*m/W, (r+1)*m/W)`` of ``sum_r a[r] @ w[r]^T``."""
    total = sum(ai.float() @ wi.float().T for ai, wi in zip(a, w))
    return list(total.chunk(len(a), dim=0))


def ag_gemm_reference(x: list[torch.Tensor], w: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per rank r: ``cat(x) @ w[r]^T``."""
    full = torch.cat([xi.float() for xi in x], dim=0)
    return [full @ wi.float().T for wi in w]
