"""The split-K reduce's arithmetic on one vector of an output row, shared by the reduce step
(``ops.gemm_split_reduce``) and the last partial tile of a split group (``ops.gemm_split`` on
the Hopper tile): both sum the ranges in range order and apply the epilogue in one order of
operations, so they give the same bits.

Plain functions of traced values (inlined where a kernel calls them): ``p4`` is the partials
viewed as (split, rows, vectors, vec) fp32, a vector is ``vec`` consecutive columns.
"""

from __future__ import annotations

from cutlass import Float32, cute


def load_ranges(p4, splits: int, row, cv, vec: int, up=None) -> tuple[list, list]:
    """Vector ``cv`` of ``row`` from each of the ``splits`` ranges (fp32 registers), and with
    ``up`` (a ``silu_mul`` GEMM: the up half's first vector) vector ``up + cv`` too; every
    load is issued before any use."""
    gates, ups = [], []
    for s in range(splits):
        g = cute.make_rmem_tensor((vec,), Float32)
        cute.autovec_copy(p4[s, row, cv, None], g)
        gates.append(g)
        if up is not None:
            u = cute.make_rmem_tensor((vec,), Float32)
            cute.autovec_copy(p4[s, row, up + cv, None], u)
            ups.append(u)
    return gates, ups


def reduce_vector(gates: list, ups: list, out, vec: int, scale=None, res=None):
    """``out[e]`` = the epilogue of the ranges' sum, rounded once to ``out``'s dtype: the sum
    in range order, times ``scale`` (a folded RMSNorm's row scale) where given, ``silu(gate) *
    up`` where ``ups`` holds the up half (its sum scaled the same), ``+ res[e]`` where a
    residual vector is given. Returns ``out``."""
    for e in range(vec):
        acc = gates[0][e]
        for s in range(1, len(gates)):
            acc = acc + gates[s][e]
        if scale is not None:
            acc = acc * scale
        if ups:
            up = ups[0][e]
            for s in range(1, len(ups)):
                up = up + ups[s][e]
            if scale is not None:
                up = up * scale
            acc = acc / (Float32(1.0) + cute.math.exp(-acc)) * up
        if res is not None:
            acc = acc + res[e].to(Float32)
        out[e] = acc.to(out.element_type)
    return out
