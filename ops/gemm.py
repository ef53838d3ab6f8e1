"""GEMM tile op: C = A @ B^T (B in nn.Linear's (out, in) layout), one (block_m, block_n) tile a task.

Optional fused epilogues: ``silu_mul``: B stacks [W_gate; W_up] (2N rows) and tile n computes
``silu(A @ W_gate[n]^T) * (A @ W_up[n]^T)``, writing an (M, N) result (Qwen3 MLP's gate/up);
``residual``: ``C = A @ B^T + R`` with R (M, N) in C's dtype, the op's third input (a
transformer block's skip connection, e.g. after the down or output projection).

A row norm folded into B (``norm_ss``, Hopper tile only): each row of the product is scaled by
``rsqrt(sum_j norm_ss[row, j] / norm_width + norm_eps)`` before the epilogue, ``norm_ss`` being
A's row sums of squares in column blocks that a split reduce with ``sumsq`` wrote
(``ops.gemm_splitk``): ``rmsnorm(A) * g @ W^T`` as ``rstd(A) * (A @ (W diag(g))^T)`` with no
norm phase and no K split (the decoder layer's post-attention norm before gate/up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import cutlass
import numpy as np
import torch
import torch.nn.functional as F
from cutlass import BFloat16, Float16, Float32, Int32, cute

from cutemk.arch import target_arch
from cutemk.costmodel import tile_time_us
from cutemk.device.config import NUM_THREADS, simt_sync
from cutemk.errors import DTypeError, GraphError, ShapeError
from cutemk.symbolic import IntLike, cdiv, upper
from . import gemm_sm90
from cutemk.tileop import (
    FLOAT_DTYPES,
    TensorSpec,
    TileOp,
    block,
    blocks,
    boxes,
    expect_dtype,
    expect_ndim,
    expect_same_dim,
    register_op,
    span,
)

EPILOGUES = (None, "silu_mul", "residual")

BLOCK_K = 32
"""K-slice staged in shared memory per main-loop step (two mma.sync k-steps of 16)."""

RASTER_GROUP = 8
"""Row tiles per group in the preferred tile order (``GemmTile.order_key``)."""

_CUTE_DTYPES = {torch.float32: Float32, torch.bfloat16: BFloat16, torch.float16: Float16}


@dataclass(frozen=True)
class GemmDevicePlan:
    """Host-side tiling facts of the device GEMM, all compile-time ints.

    ``mma_m x mma_n`` is the tile one pass of the CTA's tiled MMA covers; the staged A/B tiles
    are ``block_m``/``block_n`` rounded up to it (``pad_m``/``pad_n``), the extra rows zeroed
    and their results never stored. Shared-memory rows are ``BLOCK_K + row_pad`` elements long:
    the pad skews rows across banks, because the MMA partitions read one k of many rows at once.
    """

    simt: bool  # fp32: CUDA-core FMA (keeps fp32 accuracy); fp16/bf16: warp mma.sync
    atom_layout: tuple[int, int, int]  # threads (SIMT) or warps (mma.sync) over (m, n, k)
    mma_m: int
    mma_n: int
    pad_m: int
    pad_n: int
    row_stride: int  # elements per shared-memory row
    n_b_tiles: int  # 2 with the silu_mul epilogue (gate and up), else 1
    k_unroll: int  # unroll factor of the per-slice loop over MMA k-steps

    def smem_elems(self) -> int:
        return (self.pad_m + self.n_b_tiles * self.pad_n) * self.row_stride


@register_op
@dataclass(frozen=True)
class GemmTile(gemm_sm90.HopperGemmOp, TileOp):
    a: TensorSpec  # (m, k)
    b: TensorSpec  # (n, k), or (2n, k) with epilogue "silu_mul"
    block_m: int = 64
    block_n: int = 64
    epilogue: Optional[str] = None
    out_dtype: Optional[torch.dtype] = None
    r: Optional[TensorSpec] = None  # (m, n) with epilogue "residual"
    # the row norm (see the module doc): A's row sums of squares (m, column blocks), fp32
    norm_ss: Optional[TensorSpec] = field(default=None, kw_only=True)
    norm_width: Optional[int] = field(default=None, kw_only=True)  # K, the mean's width
    norm_eps: Optional[float] = field(default=None, kw_only=True)
    # every weight slice prefetched into L2 before the tile's events, the ring's loads then
    # served from L2 (``TileOp.prefetches_l2``; the Hopper tile only)
    l2_prefetch: bool = field(default=False, kw_only=True)

    name: ClassVar[str] = "gemm"
    outputs: ClassVar[tuple[str, ...]] = ("c",)
    split_k: ClassVar[int] = 1  # K ranges; > 1 only in the split-K partial (ops.gemm_splitk)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("a", "b") + ("r",) * (self.r is not None) + ("norm_ss",) * self._normed

    @property
    def _normed(self) -> bool:
        return self.norm_ss is not None

    def __post_init__(self) -> None:
        expect_ndim(self.a, 2, "gemm a")
        expect_ndim(self.b, 2, "gemm b")
        expect_dtype(self.a, FLOAT_DTYPES, "gemm a")
        if not isinstance(self.l2_prefetch, bool):
            raise TypeError(f"gemm l2_prefetch must be a bool, got {self.l2_prefetch!r}")
        if self.b.dtype != self.a.dtype:
            raise TypeError(f"gemm b must have a's dtype {self.a.dtype}, got {self.b.dtype}")
        expect_same_dim(self.a.shape[1], self.b.shape[1], "gemm: a.shape[1] (K) vs b.shape[1]")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"gemm epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        for f in ("block_m", "block_n"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"gemm {f} must be a positive int, got {getattr(self, f)!r}")
        if self.epilogue == "silu_mul" and isinstance(self.b.shape[0], int) and self.b.shape[0] % 2:
            raise ShapeError(
                f"gemm silu_mul epilogue needs an even b.shape[0], got {self.b.shape[0]}"
            )
        if self.out_dtype is not None and self.out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"gemm out_dtype must be one of {FLOAT_DTYPES}, got {self.out_dtype!r}")
        if (self.epilogue == "residual") != (self.r is not None):
            raise ValueError("gemm: the residual epilogue takes r, and only it does")
        if self.r is not None:
            expect_ndim(self.r, 2, "gemm r")
            expect_same_dim(self.r.shape[0], self.m, "gemm: r.shape[0] vs a.shape[0] (M)")
            expect_same_dim(self.r.shape[1], self.n, "gemm: r.shape[1] vs b.shape[0] (N)")
            out = self.out_dtype or self.a.dtype
            if self.r.dtype != out:
                raise TypeError(f"gemm r must have the output's dtype {out}, got {self.r.dtype}")
        if len({self.norm_ss is None, self.norm_width is None, self.norm_eps is None}) > 1:
            raise ValueError("gemm: norm_ss, norm_width and norm_eps go together")
        if self.norm_ss is not None:
            expect_ndim(self.norm_ss, 2, "gemm norm_ss")
            expect_dtype(self.norm_ss, (torch.float32,), "gemm norm_ss")
            expect_same_dim(self.norm_ss.shape[0], self.m, "gemm: norm_ss rows vs a rows")
            if not isinstance(self.norm_ss.shape[1], int):
                raise ShapeError("gemm: norm_ss needs a static number of column blocks")
            if not isinstance(self.norm_width, int) or self.norm_width < 1:
                raise ValueError(f"gemm norm_width must be a positive int, got {self.norm_width}")
            if not self.norm_eps > 0:
                raise ValueError(f"gemm norm_eps must be > 0, got {self.norm_eps}")

    def check_bindings(self, env) -> None:
        if self.epilogue == "silu_mul":
            rows = TensorSpec(self.b.shape, self.b.dtype).concrete(env)[0]
            if rows % 2:
                raise ShapeError(
                    f"gemm silu_mul epilogue needs an even b.shape[0] = {self.b.shape[0]}, "
                    f"got {rows}"
                )

    def check_producers(self, producers) -> None:
        if not self._normed:
            return
        src = producers.get("norm_ss")
        if getattr(src, "sumsq", False) is not True or src.n != self.norm_width:
            raise GraphError(
                "gemm: norm_ss must be the ss output of a gemm_split_reduce with sumsq over "
                f"norm_width={self.norm_width} columns"
            )
        if self.k != self.norm_width:
            raise GraphError(f"gemm: norm_width={self.norm_width}, but A has K={self.k}")

    @property
    def m(self) -> IntLike:
        return self.a.shape[0]

    @property
    def n(self) -> IntLike:
        return self.b.shape[0] // 2 if self.epilogue == "silu_mul" else self.b.shape[0]

    @property
    def k(self) -> IntLike:
        return self.a.shape[1]

    def order_key(self, coord) -> tuple:
        """Blocks of ``RASTER_GROUP`` row tiles swept across the column tiles: a wave of SMs
        then reads about ``RASTER_GROUP`` A tiles and ``SMs / RASTER_GROUP`` B tiles, which stay
        in L2, instead of one A tile and a whole row of B tiles (grid order)."""
        i, j = coord
        return (i // RASTER_GROUP, j, i % RASTER_GROUP)

    def order_key_array(self, coords):
        if type(self).order_key is not GemmTile.order_key:  # a subclass with its own order
            return super().order_key_array(coords)
        i, j = coords[:, 0], coords[:, 1]
        return np.stack([i // RASTER_GROUP, j, i % RASTER_GROUP], axis=1)

    def output_specs(self) -> dict[str, TensorSpec]:
        return {"c": TensorSpec((self.m, self.n), self.out_dtype or self.a.dtype)}

    def grid(self):
        return (cdiv(self.m, self.block_m), cdiv(self.n, self.block_n))

    def _dims(self, env):
        return tuple(d if isinstance(d, int) else d.eval(env) for d in (self.m, self.n, self.k))

    def reads(self, coord, env, data=None):
        m, n, k = self._dims(env)
        i, j = coord
        rows = block(j, self.block_n, n)
        b_box = ((rows[0], rows[1]), (0, k))
        if self.epilogue == "silu_mul":  # gate rows, then up rows: one box spanning both
            b_box = ((rows[0], n + rows[1]), (0, k))
        r = {"a": (block(i, self.block_m, m), (0, k)), "b": b_box}
        if self.r is not None:
            r["r"] = (block(i, self.block_m, m), block(j, self.block_n, n))
        if self._normed:
            r["norm_ss"] = (block(i, self.block_m, m), (0, self.norm_ss.shape[1]))
        return r

    def writes(self, coord, env, data=None):
        m, n, _ = self._dims(env)
        i, j = coord
        return {"c": (block(i, self.block_m, m), block(j, self.block_n, n))}

    uniform_cost: ClassVar[bool] = True
    token_local: ClassVar[bool] = True

    def region_arrays(self, which, env, coords):
        m, n, k = self._dims(env)
        rows = blocks(coords[:, 0], self.block_m, m)
        cols = blocks(coords[:, 1], self.block_n, n)
        if which == "writes":
            return {"c": boxes(rows, cols)}
        b_rows = cols.copy()
        if self.epilogue == "silu_mul":  # gate rows, then up rows: one box spanning both
            b_rows[:, 1] += n
        r = {"a": boxes(rows, span(0, k, len(coords))), "b": boxes(b_rows, span(0, k, len(coords)))}
        if self.r is not None:
            r["r"] = boxes(rows, cols)
        if self._normed:
            r["norm_ss"] = boxes(rows, span(0, self.norm_ss.shape[1], len(coords)))
        return r

    def cost(self, coord, env):
        _, _, k = self._dims(env)
        bm, bn = self.block_m, self.block_n
        nb = 2 if self.epilogue == "silu_mul" else 1
        es = self.a.dtype.itemsize
        return tile_time_us(
            2.0 * bm * bn * k * nb, (bm + nb * bn) * k * es + bm * bn * es, self.a.dtype
        )

    def reference(self, coord, env, t):
        m, n, _ = self._dims(env)
        (r0, r1), (c0, c1) = self.writes(coord, env)["c"]
        a = t["a"][r0:r1].float()
        scale = 1.0
        if self._normed:
            ms = t["norm_ss"][r0:r1].float().sum(-1, keepdim=True) / self.norm_width
            scale = torch.rsqrt(ms + self.norm_eps)
        if self.epilogue == "silu_mul":
            gate = (a @ t["b"][c0:c1].float().T) * scale
            up = (a @ t["b"][n + c0 : n + c1].float().T) * scale
            out = F.silu(gate) * up
        else:
            out = (a @ t["b"][c0:c1].float().T) * scale
        if self.r is not None:
            out = out + t["r"][r0:r1, c0:c1].float()
        t["c"][r0:r1, c0:c1] = out.to(t["c"].dtype)

    # -- device -----------------------------------------------------------------------------
    independent_inputs: ClassVar[tuple[str, ...]] = ("b",)

    @property
    def prefetches_l2(self) -> bool:
        return self.l2_prefetch and self.sm90() is not None

    def sm90(self) -> Optional[gemm_sm90.Sm90GemmConfig]:
        """The Hopper tile (TMA + wgmma through the megakernel's ring) where the target arch and
        the parameters allow it; else None and the portable mma.sync / SIMT tile runs."""
        if target_arch() != "sm_90a":
            return None
        return gemm_sm90.sm90_config(
            self.a.dtype,
            self.output_specs()[self.outputs[0]].dtype,
            self.block_m,
            self.block_n,
            self.k,
            self.n,
            self.epilogue == "silu_mul",
            upper(self.m),
            residual=self.r is not None,
            split=self.split_k,
            norm=(self.norm_ss.shape[1], self.norm_width, self.norm_eps) if self._normed else None,
        )

    def device_plan(self) -> GemmDevicePlan:
        simt = self.a.dtype == torch.float32
        if simt:
            atom, mma_m, mma_n, row_pad = (16, 8, 1), 16, 8, 1  # 128 threads of 1x1x1 FMA
        elif self.block_m <= 16:  # decode-sized blocks: spread the 4 warps along n
            atom, mma_m, mma_n, row_pad = (1, 4, 1), 16, 32, 8
        else:  # 4 warps of 16x8x16 mma.sync as 2x2
            atom, mma_m, mma_n, row_pad = (2, 2, 1), 32, 16, 8
        assert atom[0] * atom[1] * (1 if simt else 32) == NUM_THREADS
        return GemmDevicePlan(
            simt=simt,
            atom_layout=atom,
            mma_m=mma_m,
            mma_n=mma_n,
            pad_m=-(-self.block_m // mma_m) * mma_m,
            pad_n=-(-self.block_n // mma_n) * mma_n,
            row_stride=BLOCK_K + row_pad,
            n_b_tiles=2 if self.epilogue == "silu_mul" else 1,
            k_unroll=4 if simt else BLOCK_K // 16,
        )

    def device_smem_bytes(self) -> int:
        if self.sm90() is not None:
            return 0  # the ring and the output staging belong to the megakernel
        return self.device_plan().smem_elems() * self.a.dtype.itemsize

    @cute.jit
    def device_tile(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """The portable tile (the SIMT group): tile (coord0, coord1) of C; ``tensors`` =
        (mA, mB, [mR,] mC). mA: (m, k), mB: (n, k) or (2n, k) = [W_gate; W_up], mR: (m, n) with
        the residual epilogue, mC: (m, n)."""
        if cutlass.const_expr(self._normed):
            raise GraphError(
                "gemm with a row norm (norm_ss) runs on the Hopper tile only (sm_90a, 16-bit "
                "A and B, a tile shape wgmma takes)"
            )
        self._device_tile_mma(tensors, coord0, coord1, tidx, smem_ptr)

    @cute.jit
    def _device_tile_mma(self, tensors, coord0: Int32, coord1: Int32, tidx: Int32, smem_ptr):
        """The portable tile: fp32 SIMT, or mma.sync where the Hopper path does not apply.

        Each BLOCK_K slice of A and B is staged in shared memory by all threads (coalesced,
        zero-filled outside the tensors and the block), then the tiled MMA accumulates in fp32
        registers. Slow: no cp.async pipelining, no ldmatrix, scalar epilogue stores.
        """
        plan = self.device_plan()
        fused = self.epilogue == "silu_mul"
        ks = self.split_k  # split-K partial: K range coord1 % ks of column block coord1 // ks
        mA, mB, mC = tensors[0], tensors[1], tensors[len(tensors) - 1]
        ab_dtype = _CUTE_DTYPES[self.a.dtype]
        if cutlass.const_expr(mA.element_type != ab_dtype or mB.element_type != ab_dtype):
            raise DTypeError(
                f"gemm device_tile: a/b must be {ab_dtype} (the op's a.dtype), got "
                f"{mA.element_type}/{mB.element_type}"
            )
        m = mA.shape[0]
        n = mC.shape[len(mC.shape) - 1]
        row0 = coord0 * self.block_m
        col0 = (coord1 // ks) * self.block_n
        s = coord1 % ks
        k_len = mA.shape[1] // ks
        k_begin = s * k_len
        k = k_begin + k_len  # the end of this tile's K range

        base = cute.recast_ptr(smem_ptr, dtype=ab_dtype)
        sA = cute.make_tensor(base, _smem_layout(plan.pad_m, plan))  # (pad_m, BLOCK_K)
        sB = cute.make_tensor(base + plan.pad_m * plan.row_stride, _smem_layout(plan.pad_n, plan))
        sBu = sB  # (pad_n, BLOCK_K) up rows; aliases sB when not fused (never read then)
        if cutlass.const_expr(fused):
            off = (plan.pad_m + plan.pad_n) * plan.row_stride
            sBu = cute.make_tensor(base + off, _smem_layout(plan.pad_n, plan))

        tiled_mma = _make_tiled_mma(ab_dtype, plan)
        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)  # (MMA, MMA_M, MMA_K)
        tCsB = thr_mma.partition_B(sB)  # (MMA, MMA_N, MMA_K)
        tCsBu = thr_mma.partition_B(sBu)
        # Register fragments of one MMA k-step, refilled from shared memory each step.
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, 0])  # (MMA, MMA_M)
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, 0])  # (MMA, MMA_N)
        tCrBu = tiled_mma.make_fragment_B(tCsBu[None, None, 0])
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((plan.pad_m, plan.pad_n)))
        acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((plan.pad_m, plan.pad_n)))
        acc_up = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((plan.pad_m, plan.pad_n)))
        acc.fill(0.0)
        acc_up.fill(0.0)

        for kt in range((k_len + BLOCK_K - 1) // BLOCK_K):
            k0 = k_begin + kt * BLOCK_K
            # The previous slice (or the previous task's use of the scratch) must be consumed
            # by every thread before it is overwritten.
            simt_sync()
            _stage_rows(sA, mA, row0, row0, m, self.block_m, k0, k, tidx)
            _stage_rows(sB, mB, col0, col0, n, self.block_n, k0, k, tidx)
            if cutlass.const_expr(fused):
                _stage_rows(sBu, mB, n + col0, col0, n, self.block_n, k0, k, tidx)
            simt_sync()
            # A runtime loop over k-steps (SIMT has BLOCK_K of them): unrolling all 32 made the
            # fp32 128x128 fused tile take ~16 s to compile; unroll 4 keeps it near 4 s.
            for kb in cutlass.range(cute.size(tCsA, mode=[2]), unroll=plan.k_unroll):
                cute.autovec_copy(tCsA[None, None, kb], tCrA)
                cute.autovec_copy(tCsB[None, None, kb], tCrB)
                cute.gemm(tiled_mma, acc, tCrA, tCrB, acc)
                if cutlass.const_expr(fused):
                    cute.autovec_copy(tCsBu[None, None, kb], tCrBu)
                    cute.gemm(tiled_mma, acc_up, tCrA, tCrBu, acc_up)

        for i in cutlass.range(cute.size(acc), unroll_full=True):
            r, c = tCcC[i]
            if r < self.block_m and c < self.block_n and row0 + r < m and col0 + c < n:
                if cutlass.const_expr(ks > 1):  # the fp32 partial of K range s
                    mC[s, row0 + r, col0 + c] = acc[i]
                else:
                    v = acc[i]
                    if cutlass.const_expr(fused):
                        v = v / (Float32(1.0) + cute.math.exp(-v)) * acc_up[i]
                    if cutlass.const_expr(self.r is not None):
                        v = v + tensors[2][row0 + r, col0 + c].to(Float32)
                    mC[row0 + r, col0 + c] = v.to(mC.element_type)


def _smem_layout(rows: int, plan: GemmDevicePlan) -> cute.Layout:
    return cute.make_layout((rows, BLOCK_K), stride=(plan.row_stride, 1))


def _make_tiled_mma(ab_dtype, plan: GemmDevicePlan):
    if cutlass.const_expr(plan.simt):
        op = cute.nvgpu.MmaUniversalOp(Float32)
    else:
        op = cute.nvgpu.warp.MmaF16BF16Op(ab_dtype, Float32, (16, 8, 16))
    return cute.make_tiled_mma(op, cute.make_layout(plan.atom_layout))


@cute.jit
def _stage_rows(
    sX: cute.Tensor,  # (rows, BLOCK_K) shared
    mX: cute.Tensor,  # (*, k) global
    g_row0: Int32,
    lim_row0: Int32,
    lim: Int32,
    block_rows: cutlass.Constexpr[int],
    k0: Int32,
    k: Int32,
    tidx: Int32,
):
    """``sX[r, c] = mX[g_row0 + r, k0 + c]`` where ``r < block_rows``, ``lim_row0 + r < lim`` and
    ``k0 + c < k``, else 0 (the zeros make padded rows and the k tail contribute nothing).

    A warp covers one row of BLOCK_K consecutive elements: coalesced global reads, and shared
    writes to consecutive addresses (no bank conflicts). Out-of-range elements load a clamped
    in-range address and are then replaced by 0, so every load is unconditional and all of a
    thread's loads can be in flight together (a load under a branch would serialise them).
    """
    rows_valid = cute.min(lim - lim_row0, block_rows)  # >= 1: the tile exists
    k_last = k - 1
    for i in cutlass.range_constexpr(cute.size(sX, mode=[0]) * BLOCK_K // NUM_THREADS):
        idx = tidx + i * NUM_THREADS
        r = idx // BLOCK_K
        c = idx % BLOCK_K
        v = mX[g_row0 + cute.min(r, rows_valid - 1), cute.min(k0 + c, k_last)]
        if r >= rows_valid or k0 + c > k_last:
            v = sX.element_type(0)
        sX[r, c] = v


def gemm(
    a: TensorSpec,
    b: TensorSpec,
    *operands: TensorSpec,
    block_m: int = 64,
    block_n: int = 64,
    epilogue: Optional[str] = None,
    out_dtype: Optional[torch.dtype] = None,
    norm_width: Optional[int] = None,
    norm_eps: Optional[float] = None,
    l2_prefetch: bool = False,
) -> GemmTile:
    """C = A @ B^T with an optional fused epilogue (see module doc). ``operands``: the
    residual ``r`` (``epilogue="residual"``, which it implies when given), then, with
    ``norm_width`` and ``norm_eps``, the row norm's ``norm_ss``. ``l2_prefetch``: see
    ``GemmTile``."""
    rest = list(operands)
    norm_ss = rest.pop() if norm_width is not None and rest else None
    if len(rest) > 1:
        raise ValueError(f"gemm takes r and (with norm_width) norm_ss, got {len(operands)}")
    r = rest[0] if rest else None
    if r is not None and epilogue is None:
        epilogue = "residual"
    return GemmTile(
        a,
        b,
        block_m,
        block_n,
        epilogue,
        out_dtype,
        r,
        norm_ss=norm_ss,
        norm_width=norm_width,
        norm_eps=norm_eps,
        l2_prefetch=l2_prefetch,
    )
