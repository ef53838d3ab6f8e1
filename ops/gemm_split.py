"""Split-K GEMM with the reduce in its own tiles (``gemm_split``): no reduce step, no hop.

The decode-size GEMMs of :mod:`ops.gemm_splitk` split K over many tiles and sum the ranges in
a reduce step of their own (``gemm_split_reduce``), one hand-over more before the next GEMM.
Here the last partial tile of each output block does that reduce itself: the tiles count
themselves in a counter of the op's own, and the one that completes the group sums the ranges
(the reduce step's arithmetic, :mod:`ops.split_reduce`) and applies the epilogue. Hopper tile
only; :func:`cutemk.layers.linear` keeps the reduce step where it does not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch
import torch.nn.functional as F
from cutlass import Int32, cute

from cutemk.arch import target_arch
from cutemk.errors import GraphError, ShapeError
from cutemk.symbolic import IntLike, upper
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    block,
    blocks,
    boxes,
    expect_positive_int,
    register_op,
    span,
)

from . import gemm_sm90
from .gemm import GemmTile
from .gemm_splitk import SLICE, VEC, GemmPartialTile
from .split_reduce import SS_WIDTH
from .topk import topk_reference

TOPK_EXPERTS = SS_WIDTH
"""Experts of a router whose last tile runs the top-k: one warp's 4-column vectors (128)."""


SPLIT_EPILOGUES = ("silu_mul", "residual", None)


@register_op
@dataclass(frozen=True)
class GemmSplitTile(GemmPartialTile):
    """Split-K GEMM with the reduce in its tiles: ``C = epilogue(sum_s A[:, K_s] @ B[:, K_s]^T)``
    with no reduce step. Tile ``(i, j * split_k + s)`` is :class:`GemmPartialTile`'s (B's rows
    ``j``, K range ``s``) writing its fp32 partial to ``part[s]``; then it counts itself in
    ``counts[i, j']`` (``j'``: its output column block), and the last tile of the group (the
    ``split_k`` ranges of block j', with ``silu_mul`` those of its gate block j' and its up
    block j' + N / block_n) sums the ranges in order, applies the epilogue and writes C's
    block, resetting the counter for the next launch. Which tile is last is decided at run time
    (an atomic, not an event): C is a scatter output, so its readers wait for every tile of the
    group (the same hand-over as a reduce step's, without the hop and its tiles). Hopper tile
    only (sm_90a, 16-bit A and B).

    ``block_n`` is the partial tile's width in B's rows, as for :class:`GemmPartialTile`; with
    ``silu_mul`` (B = [W_gate; W_up], 2N rows) N must be a multiple of it, so a gate block and
    its up block pair up. Outputs ``(c, part, counts)``; ``counts`` is the op's own (zeroed).

    ``sumsq`` (not with ``silu_mul``; ``block_n`` a multiple of ``SS_WIDTH`` = 128): the
    reducing tile also writes each row's sum of the squares of the values it stored (rounded,
    as the next GEMM reads them) per 128 columns to ``ss`` (m, ceil(N / 128)) fp32, the fourth
    output: what :class:`SplitReduceTile`'s ``sumsq`` hands a folded norm (``ops.gemm``'s
    ``norm_ss``, a reduce's ``norm_width``), in narrower column blocks.

    ``topk`` = k > 0 (a MoE router: C the logits (m, E) of E = 128 experts, one output block,
    no epilogue): the reducing tile also runs each row's top-k softmax on the logits it stored
    (rounded to C's dtype, as ``ops.topk_softmax`` does with ``logits_dtype``; ties to the
    lower id, NaN never picked), a warp a row, into ``weights`` (m, k) fp32 and ``ids`` (m, k)
    int32, the outputs after ``counts``; ``topk_renormalize`` as the top-k's
    ``renormalize``. The top-k then has no phase of its own and no hand-over from the router."""

    sumsq: bool = False
    topk: int = 0
    topk_renormalize: bool = True

    name: ClassVar[str] = "gemm_split"
    scatter_outputs: ClassVar[tuple[str, ...]] = ("c", "ss", "weights", "ids")
    zeroed_outputs: ClassVar[tuple[str, ...]] = ("counts",)

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("c", "part", "counts") + ("ss",) * self.sumsq + ("weights", "ids") * (self.topk > 0)

    def __post_init__(self) -> None:
        GemmTile.__post_init__(self)
        expect_positive_int(self.split_k, "gemm_split split_k")
        if self.split_k < 2:
            raise ValueError("gemm_split split_k must be >= 2 (one range is ops.gemm), got 1")
        if self.epilogue not in SPLIT_EPILOGUES:
            raise ValueError(f"gemm_split epilogue must be one of {SPLIT_EPILOGUES}")
        if self.out_dtype not in (None, *FLOAT_DTYPES):
            raise TypeError(f"gemm_split out_dtype must be one of {FLOAT_DTYPES}")
        k, n_out, rows = self.k, self.out_n, self.b.shape[0]
        if not isinstance(k, int) or k % (self.split_k * SLICE):
            raise ShapeError(
                f"gemm_split: K={k} must be a multiple of split_k * {SLICE} = "
                f"{self.split_k * SLICE} (every range a whole number of {SLICE}-wide slices)"
            )
        if not isinstance(rows, int) or n_out % VEC or self.block_n % VEC:
            raise ShapeError(
                f"gemm_split: N={n_out} and block_n={self.block_n} must be static multiples "
                f"of {VEC} (the reduce moves {VEC} columns a thread)"
            )
        if self.epilogue == "silu_mul" and n_out % self.block_n:
            raise ShapeError(
                f"gemm_split silu_mul: N={n_out} must be a multiple of block_n={self.block_n} "
                "(a gate block and its up block reduce together)"
            )
        if self.norm_ss is not None:
            raise ValueError("gemm_split takes no row norm (norm_ss): ops.gemm applies it")
        if self.sumsq and (self.epilogue == "silu_mul" or self.block_n % SS_WIDTH):
            raise ValueError(
                f"gemm_split sumsq: not with silu_mul, and block_n={self.block_n} a multiple of "
                f"{SS_WIDTH} (a warp's columns make one sum of squares)"
            )
        if self.topk:
            expect_positive_int(self.topk, "gemm_split topk")
            if self.epilogue is not None or self.sumsq:
                raise ValueError("gemm_split topk: no epilogue and no sumsq (C is the logits)")
            if not n_out == self.block_n == TOPK_EXPERTS or self.topk > min(n_out, 32):
                raise ShapeError(
                    f"gemm_split topk: {TOPK_EXPERTS} experts in one block (block_n = N = "
                    f"{TOPK_EXPERTS}: a warp holds a row) and k <= 32, got N={n_out}, "
                    f"block_n={self.block_n}, k={self.topk}"
                )

    @property
    def picks_over(self) -> IntLike | None:
        """With ``topk``: the experts its ids name (as ``ops.topk_softmax``'s), else None."""
        return self.out_n if self.topk else None

    @property
    def n(self) -> IntLike:
        """B's rows: the partials' width (the partial tiles' column space)."""
        return self.b.shape[0]

    @property
    def out_n(self) -> IntLike:
        """C's columns: B's rows, halved by ``silu_mul``."""
        return self.b.shape[0] // 2 if self.epilogue == "silu_mul" else self.b.shape[0]

    @property
    def out_blocks(self) -> int:
        """C's column blocks: the counters' columns."""
        return -(-self.out_n // self.block_n)

    @property
    def group(self) -> int:
        """Partial tiles of one output block (the last of them reduces it)."""
        return self.split_k * (2 if self.epilogue == "silu_mul" else 1)

    def output_specs(self) -> dict[str, TensorSpec]:
        return {
            "c": TensorSpec((self.m, self.out_n), self.out_dtype or self.a.dtype),
            "part": TensorSpec((self.split_k, self.m, self.n), torch.float32),
            # sized for the most rows (static: a live token count binds only T's dims)
            "counts": TensorSpec((-(-upper(self.m) // self.block_m), self.out_blocks), torch.int32),
            **({"ss": TensorSpec((self.m, self.ss_cols), torch.float32)} if self.sumsq else {}),
            **(
                {
                    "weights": TensorSpec((self.m, self.topk), torch.float32),
                    "ids": TensorSpec((self.m, self.topk), torch.int32),
                }
                if self.topk
                else {}
            ),
        }

    @property
    def ss_cols(self) -> int:
        """Sums of squares a row (``sumsq``): one per ``SS_WIDTH`` columns of C."""
        return -(-self.out_n // SS_WIDTH)

    def _ss_box(self, coord, env):
        """The ``ss`` columns of tile ``coord``'s output block, with its rows."""
        rows, _ = self._c_box(coord, env)
        jj = self._out_block(coord[1] // self.split_k)
        return rows, block(jj, self.block_n // SS_WIDTH, self.ss_cols)

    def _out_block(self, j):
        """The output column block of partial column block ``j`` (ints or an array)."""
        return j % self.out_blocks if self.epilogue == "silu_mul" else j

    def order_key(self, coord) -> tuple:
        """A group's tiles next to each other (a gate block's ranges, then its up block's), so
        its last tile comes early."""
        i, c1 = coord
        j, s = divmod(c1, self.split_k)
        return (i, self._out_block(j), j, s)

    def order_key_array(self, coords):
        i, c1 = coords[:, 0], coords[:, 1]
        j, s = c1 // self.split_k, c1 % self.split_k
        return np.stack([i, self._out_block(j), j, s], axis=1)

    def _c_box(self, coord, env):
        m = self.m if isinstance(self.m, int) else self.m.eval(env)
        i, c1 = coord
        jj = self._out_block(c1 // self.split_k)
        return block(i, self.block_m, m), block(jj, self.block_n, self.out_n)

    def _is_last(self, coord) -> bool:
        """The tile that stands for C's writer where writes must be exact (with data): the
        last range of the group's last column block."""
        j, s = divmod(coord[1], self.split_k)
        up = self.epilogue != "silu_mul" or j >= self.out_blocks
        return up and s == self.split_k - 1

    def reads(self, coord, env, data=None):
        r = super().reads(coord, env, data)
        if self.r is not None:  # the reducing tile's residual; any tile of the group may be it
            r["r"] = self._c_box(coord, env)
        return r

    def writes(self, coord, env, data=None):
        w = super().writes(coord, env, data)
        if data is None or self._is_last(coord):
            w["c"] = self._c_box(coord, env)
            if self.sumsq:
                w["ss"] = self._ss_box(coord, env)
            if self.topk:
                rows, _ = self._c_box(coord, env)
                w["weights"] = w["ids"] = (rows, (0, self.topk))
        return w

    def region_arrays(self, which, env, coords):
        arrays = super().region_arrays(which, env, coords)
        if which == "writes" or self.r is not None:
            m = self.m if isinstance(self.m, int) else self.m.eval(env)
            rows = blocks(coords[:, 0], self.block_m, m)
            jj = self._out_block(coords[:, 1] // self.split_k)
            box = boxes(rows, blocks(jj, self.block_n, self.out_n))
            arrays["c" if which == "writes" else "r"] = box
            if which == "writes" and self.sumsq:
                arrays["ss"] = boxes(rows, blocks(jj, self.block_n // SS_WIDTH, self.ss_cols))
            if which == "writes" and self.topk:
                arrays["weights"] = arrays["ids"] = boxes(rows, span(0, self.topk, len(coords)))
        return arrays

    def reference(self, coord, env, t):
        super().reference(coord, env, t)
        (r0, r1), (c0, c1) = self._c_box(coord, env)
        i = coord[0]
        jj = self._out_block(coord[1] // self.split_k)
        t["counts"][i, jj] += 1
        if int(t["counts"][i, jj]) < self.group:
            return
        t["counts"][i, jj] = 0
        part = t["part"][:, r0:r1]

        def summed(lo, hi):  # range order, as the device sums
            acc = part[0, :, lo:hi].clone()
            for s in range(1, self.split_k):
                acc = acc + part[s, :, lo:hi]
            return acc

        v = summed(c0, c1)
        if self.epilogue == "silu_mul":
            n = self.out_n
            v = F.silu(v) * summed(n + c0, n + c1)
        if self.r is not None:
            v = v + t["r"][r0:r1, c0:c1].float()
        t["c"][r0:r1, c0:c1] = v.to(t["c"].dtype)
        if self.sumsq:  # of the values as stored, SS_WIDTH columns a sum
            sq = t["c"][r0:r1, c0:c1].float().square()
            for lo in range(0, c1 - c0, SS_WIDTH):
                col = (c0 + lo) // SS_WIDTH
                t["ss"][r0:r1, col] = sq[:, lo : lo + SS_WIDTH].sum(-1)
        if self.topk:  # on the logits as stored
            w, ids = topk_reference(t["c"][r0:r1].float(), self.topk, self.topk_renormalize)
            t["weights"][r0:r1], t["ids"][r0:r1] = w, ids

    def sm90(self) -> Optional[gemm_sm90.Sm90GemmConfig]:
        if target_arch() != "sm_90a":
            return None
        return gemm_sm90.sm90_config(
            self.a.dtype,
            torch.float32,
            self.block_m,
            self.block_n,
            self.k,
            self.n,
            False,
            upper(self.m),
            split=self.split_k,
            reduce={None: "sum"}.get(self.epilogue, self.epilogue),
            reduce_blocks=self.out_blocks,
            reduce_sumsq=self.sumsq,
            reduce_topk=self.topk,
            reduce_renorm=self.topk_renormalize and self.topk > 0,
        )

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        raise GraphError(
            "gemm_split (the reduce in the tiles) runs on the Hopper tile only (sm_90a, 16-bit "
            "A and B, a tile shape wgmma takes); use gemm_partial and gemm_split_reduce"
        )


def gemm_split(
    a: TensorSpec,
    b: TensorSpec,
    *operands: TensorSpec,
    split_k: int,
    epilogue: Optional[str] = None,
    out_dtype: Optional[torch.dtype] = None,
    block_m: int = 64,
    block_n: int = 256,
    sumsq: bool = False,
    l2_prefetch: bool = False,
    topk: int = 0,
    topk_renormalize: bool = True,
) -> GemmSplitTile:
    """``epilogue(a @ b^T)`` split along K into ``split_k`` ranges, the last partial tile of
    each output block reducing it (:class:`GemmSplitTile`); ``operands``: the residual ``r``
    (which implies the residual epilogue). Outputs ``(c, part, counts)``, then ``ss`` with
    ``sumsq``, ``(weights, ids)`` with ``topk``. ``l2_prefetch``: see ``GemmTile``."""
    if len(operands) > 1:
        raise ValueError(f"gemm_split takes one operand (r), got {len(operands)}")
    r = operands[0] if operands else None
    if r is not None and epilogue is None:
        epilogue = "residual"
    return GemmSplitTile(
        a,
        b,
        block_m,
        block_n,
        epilogue,
        out_dtype,
        r,
        split_k=split_k,
        sumsq=sumsq,
        l2_prefetch=l2_prefetch,
        topk=topk,
        topk_renormalize=topk_renormalize,
    )
