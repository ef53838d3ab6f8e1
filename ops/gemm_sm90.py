"""Hopper (sm_90a) device path of the GEMM tile: TMA through the megakernel's ring, wgmma on two
consumer warpgroups, the output staged in shared memory and written by a TMA store.

One task computes one ``(bm, bn)`` tile of ``C = A @ B^T`` (with ``silu_mul``: B stacks
``[W_gate; W_up]`` and the tile is ``silu(A W_gate^T) * (A W_up^T)``). The megakernel owns the
shared-memory ring (``cutemk.device.ring``); this module supplies the per-slice copies and the
consumers' main loop and epilogue:

- **Host** (``tma_args``, traced into the launch function): TMA descriptors for A, B (two with
  the ``silu_mul`` epilogue: the gate and the up half of B, each bounded by its own descriptor)
  and C (the store). Built from the launch's tensors, so rows of A past their extent load as
  zeros and rows of C past it are never written: no masks anywhere. A launch taking its token
  count as device data (``cutemk.live``) passes its tensors at the maximum count, so there the
  rows between the plan's count and the maximum load what the buffer holds and are stored:
  tiles own whole rows, and no live token reads those (``TileOp.token_local``).
- **Producer warp**: ``load_weights`` (B, which no task of the launch writes: issued *before*
  the task's events are met) and ``load_activations`` (A, issued after the acquire and a
  ``fence.proxy.async``) for one BLOCK_K slice into one ring slot.
- **Consumers** (``compute``): both warpgroups wait for each slice, issue ``wgmma`` (128-row
  tiles: one 64-row half per warpgroup; 64-row tiles: one column half per warpgroup), free the
  slot of the batch before, then write the tile to shared memory (once the storer has read the
  previous one) and fence it into the async proxy.
- **Storer warp** (``store``): issues the TMA store of the staged tile; the megakernel waits
  for it and fences it back before the notify, while the consumers run their next tile.

A ring slot holds A, then B, then (fused) the up half of B for one k-slice; every GEMM node of a
kernel views the same slots with its own layouts, stage stride = the kernel's slot size.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Float16, Float32, Int32, cute
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cutemk.device.config import CONSUMER_BARRIER, WARP_SIZE, WARPGROUP, named_sync
from cutemk.device.ring import consumer_release, consumer_wait, epi_acquire, plain_wait
from cutemk.tileop import RingTile

from .moe_combine_sm90 import combine_in_tile, pick_weight
from .split_reduce import SS_WIDTH, reduce_last_tile

BLOCK_K = 64
"""k-slice per ring slot: 64 bf16 = one 128-byte swizzle row."""

MAX_ACC_PER_THREAD = 128
"""fp32 accumulators per consumer thread (gate and up together): what fits beside the rest
of the consumer's 232 registers."""

CONSUMER_WARPGROUPS = 2
CONSUMER_THREADS = CONSUMER_WARPGROUPS * WARPGROUP
STORE_THREADS = CONSUMER_THREADS + WARP_SIZE  # the epilogue barriers: consumers + storer warp

_CUTE_DTYPES = {torch.bfloat16: BFloat16, torch.float16: Float16, torch.float32: Float32}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Sm90GemmConfig:
    """Compile-time shape of the Hopper tile: ``bm x bn`` outputs, ``n_b`` B tiles (2 when the
    gate and up products are fused), ``k_tiles`` slices of ``BLOCK_K``."""

    bm: int
    bn: int
    n_b: int
    k_tiles: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    a_rows: int  # rows of A each slice loads: bm, or the most rows A can have when fewer
    grouped: bool = False  # B is (experts, n, k); the tile's expert is tile_info[coord0, 0]
    # the epilogue adds R (m, n), the op's third tensor; with ``combine_k`` the combine adds
    # R (T, n), the op's fifth
    residual: bool = False
    # K splits (split-K): tile (coord0, coord1) is K range ``coord1 % split`` of column block
    # ``coord1 // split``, its fp32 partial written straight to part[split index] (no staging)
    split: int = 1
    # the row norm (``ops.gemm``'s norm_ss): column blocks of the sums of squares (0: none),
    # the width the mean is over, epsilon
    norm_blocks: int = 0
    norm_width: int = 0
    norm_eps: float = 0.0
    # grouped, A is one box of ``a_rows`` rows that every tile loads (the token-major x of a
    # slot-layout grouped GEMM, ``ops.moe_grouped_gemm``), not tile coord0's rows
    a_one_box: bool = False
    # grouped over the slot layout with the MoE combine fused (``ops.moe_slot_gemm``'s
    # ``combine``): the top-k (0: none); tile i is pick i % k of token i // k, its weighted fp32
    # row goes from registers to ``part`` and the last pick of a column block sums the k rows
    combine_k: int = 0
    # split-K with the reduce in the tiles (``ops.gemm_split``): "" (none, the partials only),
    # "sum", "silu_mul" or "residual"; the last of a group of partial tiles (the ``split``
    # ranges of an output column block, of its gate and its up block with silu_mul) sums them
    # and applies the epilogue. ``reduce_blocks``: the output's column blocks (the counters'
    # columns; with silu_mul the gate half's blocks, so up block j + reduce_blocks is gate j's)
    reduce: str = ""
    reduce_blocks: int = 0
    # with ``reduce``: the reducing tile also writes its rows' sums of squares of the stored
    # values, one per SS_WIDTH columns, to ``ss`` (the next GEMM's folded norm, ``ops.gemm``'s
    # norm_ss)
    reduce_sumsq: bool = False
    # with ``reduce`` "sum" over one 128-column output block (a MoE router's logits): the
    # reducing tile also runs the top-k softmax of each row it reduced (k picks, ``weights``
    # and ``ids`` after the counters), a warp a row (``ops.gemm_split``'s ``topk``)
    reduce_topk: int = 0
    reduce_renorm: bool = False

    @property
    def extra0(self) -> int:
        """Index of the first host argument (TMA atoms) in the op's tensors: after (A, B, C),
        (A, B, R, C) with a residual, (A, B, [R,] SS, C) with the row norm, (A, B,
        tile_info, C) when grouped, (A, B, ids, weights, [R,] y, part, counts) with the
        combine, or (A, B, [R,] C, part, counts[, SS][, weights, ids]) with the split's
        reduce in the tiles."""
        if self.combine_k:
            return 7 + int(self.residual)
        if self.reduce:
            n = 5 + int(self.reduce == "residual") + int(self.reduce_sumsq)
            return n + 2 * int(self.reduce_topk > 0)
        return 3 + int(self.grouped) + int(self.residual) + int(self.norm_blocks > 0)

    @property
    def part_index(self) -> int:
        """Index of a split-K tile's partials (split, m, n) fp32 in the op's tensors: after
        (A, B, [R,] C) with the reduce in the tiles."""
        return 3 + int(self.reduce == "residual") if self.reduce else 2

    @property
    def reduce_group(self) -> int:
        """Partial tiles counted per output block before the last one reduces it."""
        return self.split * (2 if self.reduce == "silu_mul" else 1)

    @property
    def from_registers(self) -> bool:
        """The tile's output goes from registers to global memory (split-K partials, the
        combine's rows): nothing is staged and the storer has nothing to store."""
        return self.split > 1 or self.combine_k > 0

    @property
    def a_bytes(self) -> int:
        """Room of A in a slot (wgmma reads bm rows; rows past ``a_rows`` hold stale data that
        only reaches output rows past the tensor, which the TMA store never writes)."""
        return self.bm * BLOCK_K * self.dtype.itemsize

    @property
    def b_bytes(self) -> int:
        return self.bn * BLOCK_K * self.dtype.itemsize

    @property
    def stage_bytes(self) -> int:
        """TMA bytes that land in one slot per k-slice (the full barrier's transaction count)."""
        return self.a_rows * BLOCK_K * self.dtype.itemsize + self.n_b * self.b_bytes

    @property
    def slot_bytes(self) -> int:
        """Room one slice takes in a slot: all bm rows of A (wgmma reads them), then B."""
        return _round_up(self.a_bytes + self.n_b * self.b_bytes, 1024)

    @property
    def epi_bytes(self) -> int:
        """The staged tile, then (with the row norm) the rows' scales in fp32."""
        if self.combine_k or self.reduce or self.split > 1:
            return 0  # partials go from registers to global memory, nothing is staged
        scales = 4 * self.bm if self.norm_blocks else 0
        return _round_up(self.bm * self.bn * self.out_dtype.itemsize + scales, 1024)

    @property
    def atom_layout(self) -> tuple[int, int, int]:
        """Warpgroups over (m, n, k): 128-row tiles split rows, 64-row tiles split columns."""
        return (2, 1, 1) if self.bm == 128 else (1, 2, 1)

    @property
    def wg_n(self) -> int:
        return self.bn if self.bm == 128 else self.bn // 2


def sm90_config(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    block_m: int,
    block_n: int,
    k,
    n,
    fused: bool,
    m_max: int | None = None,
    grouped: bool = False,
    residual: bool = False,
    split: int = 1,
    norm: tuple[int, int, float] | None = None,
    a_one_box: bool = False,
    combine_k: int = 0,
    reduce: str = "",
    reduce_blocks: int = 0,
    reduce_sumsq: bool = False,
    reduce_topk: int = 0,
    reduce_renorm: bool = False,
) -> Sm90GemmConfig | None:
    """The Hopper tile for these parameters, or None where the wgmma path does not apply
    (fp32 inputs, a block shape wgmma does not tile, or a K / N whose rows TMA cannot address).

    ``m_max``, the most rows A can have: below ``block_m`` the A loads shrink to it (rounded up
    to a power of two, at least the 8-row swizzle atom). At decode sizes a 64-row box of mostly out-of-bounds rows
    measured ~1.5x slower than a box of rows that exist (zero fill is not free).

    ``grouped``: A is in a grouped layout of ``block_m``-row tiles and ``m_max`` is the most
    rows one tile can hold; the A box shrinks to a power of two >= ``m_max`` dividing
    ``block_m``, so tile i's rows start at box ``i * block_m / a_rows``; with ``a_one_box``
    every tile loads box 0 (A holds at most ``m_max`` rows).

    ``split`` > 1: a split-K partial tile (fp32 output, K a multiple of ``split * BLOCK_K``,
    each tile ``K / split`` of it), see ``ops.gemm_splitk``.

    ``norm``: ``(column blocks, width, eps)`` of the row norm (see ``ops.gemm``).

    ``combine_k``: the slot layout's top-k, with the MoE combine fused into the tile (grouped,
    no epilogue, see ``ops.moe_grouped_gemm``).

    ``reduce`` / ``reduce_blocks`` / ``reduce_sumsq`` / ``reduce_topk`` / ``reduce_renorm``: a
    split-K tile whose group's last tile reduces the partials (see :class:`Sm90GemmConfig` and
    ``ops.gemm_split``)."""
    if dtype not in (torch.bfloat16, torch.float16) or out_dtype not in _CUTE_DTYPES:
        return None
    n_b = 2 if fused else 1
    if block_m not in (64, 128):
        return None
    wg_n = block_n if block_m == 128 else block_n // 2
    if block_n % 16 or not 8 <= wg_n <= 256:
        return None
    if block_m * block_n * n_b > MAX_ACC_PER_THREAD * CONSUMER_THREADS:
        return None
    # TMA needs 16-byte aligned row strides: K (A, B) and N (C) must be known to guarantee it
    if not isinstance(k, int) or (k * dtype.itemsize) % 16:
        return None
    if not isinstance(n, int) or (n * out_dtype.itemsize) % 16:
        return None
    if split > 1 and (out_dtype != torch.float32 or fused or grouped or residual):
        return None
    if split > 1 and k % (split * BLOCK_K):
        return None
    if norm is not None and (split > 1 or grouped):
        return None
    if combine_k and (not grouped or fused or split > 1 or norm is not None):
        return None
    if reduce and (split < 2 or reduce not in ("sum", "silu_mul", "residual") or reduce_blocks < 1):
        return None
    # the sums of squares: a warp's vectors are one SS_WIDTH-wide column group of one row
    if reduce_sumsq and (not reduce or reduce == "silu_mul" or block_n % SS_WIDTH):
        return None
    # the top-k: one output block of SS_WIDTH columns, a warp's 4-column vectors one row
    if reduce_topk and (reduce != "sum" or reduce_sumsq or block_n != SS_WIDTH or n != block_n):
        return None
    # a power of two >= 8: the swizzled A layout of other row counts (e.g. 40) aborts the
    # compiler
    a_rows = block_m
    if m_max is not None:
        a_rows = min(block_m, max(8, 1 << (max(m_max, 1) - 1).bit_length()))
    k_tiles = -(-k // BLOCK_K) // split
    nb, width, eps = norm or (0, 0, 0.0)
    return Sm90GemmConfig(
        block_m,
        block_n,
        n_b,
        k_tiles,
        dtype,
        out_dtype,
        a_rows,
        grouped,
        residual,
        split,
        nb,
        width,
        float(eps),
        bool(grouped and a_one_box),
        combine_k,
        reduce,
        reduce_blocks,
        reduce_sumsq,
        reduce_topk,
        bool(reduce_renorm),
    )


def _staged(layout, stages: int, slot_bytes: int, itemsize: int):
    """``layout`` (one k-slice, swizzled) repeated over ``stages`` ring slots ``slot_bytes``
    apart: the stage mode's stride is the kernel's slot size, not this operand's size."""
    o = layout.outer
    outer = cute.make_layout(
        (o.shape[0], o.shape[1], (1, stages)),
        stride=(o.stride[0], o.stride[1], (0, slot_bytes // itemsize)),
    )
    return cute.make_composed_layout(layout.inner, 0, outer)


def _slice_layouts(cfg: Sm90GemmConfig, a_rows: int | None = None):
    """One k-slice of A (``a_rows`` rows, default bm) and of B, swizzled."""
    ab = _CUTE_DTYPES[cfg.dtype]
    tile = (a_rows or cfg.bm, cfg.bn, BLOCK_K)
    a = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, ab, 1)
    b = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, ab, 1)
    return a, b


def _swizzle_bytes(row_bytes: int) -> int:
    """The swizzle width the library's atom heuristic picks for rows of ``row_bytes``."""
    return next((w for w in (128, 64, 32) if row_bytes % w == 0), 16)


def _epi_layout(cfg: Sm90GemmConfig):
    """The staged tile, swizzled by an atom as wide as the tile's rows allow, unless one
    warpgroup's columns (a 64-row tile splits its columns over the two) are not a whole
    number of that atom's: then by one sized for a warpgroup's columns (a 64 x 96 tile: 32B
    atoms of 16 columns, not 64B atoms of 32, which the two 48-column halves would cut)."""
    out = _CUTE_DTYPES[cfg.out_dtype]
    es = cfg.out_dtype.itemsize
    cols = cfg.bn
    if (cfg.wg_n * es) % _swizzle_bytes(cfg.bn * es):
        cols = cfg.wg_n
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, out, cols)
    atom = sm90_utils.make_smem_layout_atom(kind, out)
    epi = cute.tile_to_shape(atom, (cfg.bm, cfg.bn, 1), (0, 1, 2))
    return cute.slice_(epi, (None, None, 0))


def _tiled_mma(cfg: Sm90GemmConfig):
    ab = _CUTE_DTYPES[cfg.dtype]
    return sm90_utils.make_trivial_tiled_mma(
        ab,
        ab,
        OperandMajorMode.K,
        OperandMajorMode.K,
        Float32,
        cfg.atom_layout,
        tiler_mn=(64, cfg.wg_n),
    )


def tma_args(cfg: Sm90GemmConfig, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor) -> tuple:
    """Host side (inside a ``@cute.jit`` launch): ``(atom_a, tma_a, atom_b, tma_b, atom_u,
    tma_u, atom_c, tma_c)``; without the fused epilogue the ``u`` pair repeats B's; a split-K
    partial has no ``c`` pair.
    mA: (m, k); mB: (n, k) or (2n, k) = [W_gate; W_up], grouped (experts, n or 2n, k);
    mC: (m, n). Grouped, B's descriptors are (n, k, experts): the expert is a coordinate."""
    a_one, b_one = _slice_layouts(cfg, cfg.a_rows)
    a_one = cute.slice_(a_one, (None, None, 0))
    b_one = cute.slice_(b_one, (None, None, 0))
    load = cpasync.CopyBulkTensorTileG2SOp()
    atom_a, tma_a = cpasync.make_tiled_tma_atom(load, mA, a_one, (cfg.a_rows, BLOCK_K))
    n = mC.shape[len(mC.shape) - 1]  # C (m, n), or a split-K partial (splits, m, n)
    if cutlass.const_expr(cfg.grouped):
        nkl = cute.make_layout(
            (n, mB.shape[2], mB.shape[0]), stride=(mB.stride[1], mB.stride[2], mB.stride[0])
        )
        gate = cute.make_tensor(mB.iterator, nkl)
        up = cute.make_tensor(mB.iterator + n * mB.stride[1], nkl)
    else:
        half = cute.make_layout((n, mB.shape[1]), stride=mB.stride)
        gate = cute.make_tensor(mB.iterator, half)
        up = cute.make_tensor(mB.iterator + n * mB.stride[0], half)
    if cutlass.const_expr(cfg.n_b == 1):
        atom_b, tma_b = cpasync.make_tiled_tma_atom(load, gate, b_one, (cfg.bn, BLOCK_K))
        atom_u, tma_u = atom_b, tma_b
    else:
        atom_b, tma_b = cpasync.make_tiled_tma_atom(load, gate, b_one, (cfg.bn, BLOCK_K))
        atom_u, tma_u = cpasync.make_tiled_tma_atom(load, up, b_one, (cfg.bn, BLOCK_K))
    if cutlass.const_expr(cfg.from_registers):  # nothing is TMA-stored
        return atom_a, tma_a, atom_b, tma_b, atom_u, tma_u
    store = cpasync.CopyBulkTensorTileS2GOp()
    atom_c, tma_c = cpasync.make_tiled_tma_atom(store, mC, _epi_layout(cfg), (cfg.bm, cfg.bn))
    return atom_a, tma_a, atom_b, tma_b, atom_u, tma_u, atom_c, tma_c


def _ring_views(
    cfg: Sm90GemmConfig, ring_ptr, stages: int, slot_bytes: int, a_rows: int | None = None
):
    """This op's (rows, BLOCK_K, slot) views of the kernel's ring: A (its first ``a_rows``
    rows, default all), B and the up half."""
    ab = _CUTE_DTYPES[cfg.dtype]
    es = cfg.dtype.itemsize
    a_one, b_one = _slice_layouts(cfg, a_rows)
    a_l = _staged(a_one, stages, slot_bytes, es)
    b_l = _staged(b_one, stages, slot_bytes, es)
    sA = cute.make_tensor(cute.recast_ptr(ring_ptr, a_l.inner, dtype=ab), a_l.outer)
    sB = cute.make_tensor(cute.recast_ptr(ring_ptr + cfg.a_bytes, b_l.inner, dtype=ab), b_l.outer)
    sU = cute.make_tensor(
        cute.recast_ptr(ring_ptr + cfg.a_bytes + cfg.b_bytes, b_l.inner, dtype=ab), b_l.outer
    )
    return sA, sB, sU


@cute.jit
def store(cfg: cutlass.Constexpr, tensors, coord0: Int32, coord1: Int32, epi_ptr):
    """Storer warp: TMA-store the staged tile (coord0, coord1) of C (rows and columns past C's
    extent, the descriptor's, are clipped by the copy engine). A split-K partial or a combine
    tile has nothing staged."""
    if cutlass.const_expr(cfg.from_registers):
        return
    out = _CUTE_DTYPES[cfg.out_dtype]
    epi = _epi_layout(cfg)
    sC = cute.make_tensor(cute.recast_ptr(epi_ptr, epi.inner, dtype=out), epi.outer)
    x = cfg.extra0
    gC = cute.local_tile(tensors[x + 7], (cfg.bm, cfg.bn), (coord0, coord1))
    tsC, tgC = cpasync.tma_partition(
        tensors[x + 6],
        0,
        cute.make_layout(1),
        cute.group_modes(sC, 0, 2),
        cute.group_modes(gC, 0, 2),
    )
    cute.copy(tensors[x + 6], tsC, tgC)


@cute.jit
def _copy_slice(atom, tma, s, coord: Int32, rows: int, kt: Int32, idx: Int32, bar):
    """TMA one (rows, BLOCK_K) slice ``kt`` of row block ``coord`` into ring slot ``idx``."""
    g = cute.local_tile(tma, (rows, BLOCK_K), (coord, None))
    ts, tg = cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
    )
    cute.copy(atom, tg[(None, kt)], ts[(None, idx)], tma_bar_ptr=bar)


@cute.jit
def _prefetch_slice(atom, tma, s, coord: Int32, rows: int, kt: Int32):
    """TMA-prefetch into L2 what :func:`_copy_slice` would load of slice ``kt`` (``s``, any
    ring view of the slice's shape, only shapes the partition)."""
    g = cute.local_tile(tma, (rows, BLOCK_K), (coord, None))
    _, tg = cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
    )
    cute.prefetch(atom, tg[(None, kt)])


@cute.jit
def _weight_slice(cfg: cutlass.Constexpr, tensors, expert: Int32, coord1: Int32, kt: Int32):
    """(B's and the up half's TMA tensors, column block, slice) of a tile's weight slice
    ``kt``: split-K ranges and a grouped tile's expert resolved."""
    x = cfg.extra0
    tma_b, tma_u = tensors[x + 3], tensors[x + 5]
    if cutlass.const_expr(cfg.split > 1):  # K range coord1 % split of column block coord1 // split
        kt = kt + (coord1 % cfg.split) * cfg.k_tiles
        coord1 = coord1 // cfg.split
    if cutlass.const_expr(cfg.combine_k):
        # every pick has a tile (the combine counts k of them): a pick without an expert
        # streams expert 0's weights and contributes NaN
        expert = cute.max(Int32(0), cute.min(expert, tensors[1].shape[0] - 1))
    if cutlass.const_expr(cfg.grouped):
        tma_b = tma_b[None, None, expert]
        tma_u = tma_u[None, None, expert]
    return tma_b, tma_u, coord1, kt


@cute.jit
def load_weights(
    cfg: cutlass.Constexpr,
    tensors,
    expert: Int32,
    coord1: Int32,
    kt: Int32,
    idx: Int32,
    bar,
    ring,
    stages,
    slot,
):
    """Producer warp: B (and the up half) of slice ``kt`` into slot ``idx``; grouped, of
    ``expert`` (the task word: ``tile_info[coord0, 0]``, read once per task)."""
    _, sB, sU = _ring_views(cfg, ring, stages, slot)
    x = cfg.extra0
    tma_b, tma_u, coord1, kt = _weight_slice(cfg, tensors, expert, coord1, kt)
    _copy_slice(tensors[x + 2], tma_b, sB, coord1, cfg.bn, kt, idx, bar)
    if cutlass.const_expr(cfg.n_b == 2):
        _copy_slice(tensors[x + 4], tma_u, sU, coord1, cfg.bn, kt, idx, bar)


@cute.jit
def prefetch_weights(
    cfg: cutlass.Constexpr, tensors, expert: Int32, coord1: Int32, kt: Int32, ring, stages, slot
):
    """One producer lane: B (and the up half) of slice ``kt`` into L2 (no slot, no barrier),
    so that its ring load, issued once a slot frees, reads L2 (``GemmTile.l2_prefetch``)."""
    _, sB, sU = _ring_views(cfg, ring, stages, slot)
    x = cfg.extra0
    tma_b, tma_u, coord1, kt = _weight_slice(cfg, tensors, expert, coord1, kt)
    _prefetch_slice(tensors[x + 2], tma_b, sB, coord1, cfg.bn, kt)
    if cutlass.const_expr(cfg.n_b == 2):
        _prefetch_slice(tensors[x + 4], tma_u, sU, coord1, cfg.bn, kt)


@cute.jit
def load_activations(
    cfg: cutlass.Constexpr,
    tensors,
    coord0: Int32,
    coord1: Int32,
    kt: Int32,
    idx: Int32,
    bar,
    ring,
    stages,
    slot,
):
    """Producer warp: A of slice ``kt`` into slot ``idx`` (after the task's events)."""
    if cutlass.const_expr(cfg.split > 1):
        kt = kt + (coord1 % cfg.split) * cfg.k_tiles
    # a_rows < bm only where A has a single row block (coord0 == 0), or grouped, where it
    # divides bm and tile coord0 starts at box coord0 * bm / a_rows
    sA, _, _ = _ring_views(cfg, ring, stages, slot, cfg.a_rows)
    box = coord0
    if cutlass.const_expr(cfg.a_one_box):
        box = Int32(0)
    elif cutlass.const_expr(cfg.grouped):
        box = coord0 * (cfg.bm // cfg.a_rows)
    x = cfg.extra0
    _copy_slice(tensors[x], tensors[x + 1], sA, box, cfg.a_rows, kt, idx, bar)


@cute.jit
def compute(
    cfg: cutlass.Constexpr,
    tensors,
    coord0: Int32,
    coord1: Int32,
    full,
    empty,
    count: Int32,
    ring,
    stages: cutlass.Constexpr,
    slot: cutlass.Constexpr,
    epi_ptr,
    ctid: Int32,
    wait=plain_wait,
    epi_free=None,
    word=None,
) -> Int32:
    """Consumer warpgroups: the tile's main loop over ring slices ``count ..`` and its output
    staged in shared memory (``store`` writes it out); returns the ring count after the tile.
    ``word``: the task word (a grouped tile's expert id as the routing wrote it)."""
    fused = cfg.n_b == 2
    sA, sB, sU = _ring_views(cfg, ring, stages, slot)
    tiled_mma = _tiled_mma(cfg)
    wg = cute.arch.make_warp_uniform(ctid // WARPGROUP)
    lane = ctid % 32
    wg_mma = tiled_mma.get_slice(wg * WARPGROUP)  # this warpgroup's smem descriptors
    tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
    tCrU = tiled_mma.make_fragment_B(wg_mma.partition_B(sU))
    thr_mma = tiled_mma.get_slice(ctid)
    tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.bm, cfg.bn)))
    acc = cute.make_rmem_tensor(tCcC.shape, Float32)
    acc_up = cute.make_rmem_tensor(tCcC.shape, Float32)
    acc.fill(0.0)
    if cutlass.const_expr(fused):
        acc_up.fill(0.0)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    rs = Float32(1.0)  # with the row norm: the scale of the tile's row ``ctid``
    pick_w = Float32(0.0)
    if cutlass.const_expr(cfg.combine_k):  # loaded now, used after the main loop
        pick_w = pick_weight(cfg, tensors, coord0, word)

    for kt in cutlass.range(cfg.k_tiles, unroll=1):
        idx = consumer_wait(full, count + kt, stages, wait)
        if cutlass.const_expr(cfg.norm_blocks > 0):
            if kt == 0:  # A's first slice is in: its producers' sums of squares are out too
                rs = _row_scale(cfg, tensors[2 + int(cfg.residual)], coord0, ctid)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            s = (None, None, kb, idx)
            cute.gemm(tiled_mma, acc, tCrA[s], tCrB[s], acc)
            if cutlass.const_expr(fused):
                cute.gemm(tiled_mma, acc_up, tCrA[s], tCrU[s], acc_up)
        warpgroup.commit_group()
        warpgroup.wait_group(1)  # the batch before this one has read its slot: free it
        if kt > 0:
            consumer_release(empty, count + kt - 1, stages, lane)
    warpgroup.wait_group(0)
    consumer_release(empty, count + cfg.k_tiles - 1, stages, lane)

    if cutlass.const_expr(cfg.split > 1):
        _store_partial(cfg, tensors[cfg.part_index], acc, tCcC, coord0, coord1, epi_free)
        if cutlass.const_expr(cfg.reduce != ""):
            reduce_last_tile(cfg, tensors, coord0, coord1, ctid, CONSUMER_THREADS)
        return count + cfg.k_tiles
    if cutlass.const_expr(cfg.combine_k):
        combine_in_tile(
            cfg,
            tensors,
            acc,
            tCcC,
            coord0,
            coord1,
            pick_w,
            ctid,
            epi_free,
            CONSUMER_THREADS,
            STORE_THREADS,
        )
        return count + cfg.k_tiles

    # epilogue: registers -> shared memory (swizzled); the storer warp issues the TMA store
    out = _CUTE_DTYPES[cfg.out_dtype]
    epi = _epi_layout(cfg)
    sC = cute.make_tensor(cute.recast_ptr(epi_ptr, epi.inner, dtype=out), epi.outer)
    tCsC = thr_mma.partition_C(sC)
    # the previous tile's TMA store has read sC
    epi_acquire(epi_free, STORE_THREADS)
    if cutlass.const_expr(cfg.norm_blocks > 0):
        # every consumer of the previous tile read its scales before the store that the
        # barrier above waited for: the scales' room is free
        sScale = cute.make_tensor(
            cute.recast_ptr(epi_ptr, dtype=Float32) + cfg.bm * cfg.bn * cfg.out_dtype.itemsize // 4,
            cute.make_layout(cfg.bm),
        )
        if ctid < cfg.bm:
            sScale[ctid] = rs
        named_sync(CONSUMER_BARRIER, CONSUMER_THREADS)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, _ = tCcC[i]
            acc[i] = acc[i] * sScale[r]
            if cutlass.const_expr(fused):
                acc_up[i] = acc_up[i] * sScale[r]
    if cutlass.const_expr(cfg.residual):  # R's rows and columns inside the tensor only
        mR = tensors[2]
        r0 = coord0 * cfg.bm
        c0 = coord1 * cfg.bn
        rows = mR.shape[0]
        cols = mR.shape[1]
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = tCcC[i]
            if r0 + r < rows and c0 + c < cols:
                acc[i] = acc[i] + mR[r0 + r, c0 + c].to(Float32)
    for i in cutlass.range_constexpr(cute.size(acc)):
        v = acc[i]
        if cutlass.const_expr(fused):
            v = v / (Float32(1.0) + cute.math.exp(-v)) * acc_up[i]
        tCsC[i] = v.to(out)
    # generic-proxy shared-memory writes -> the TMA engine's reads
    cute.arch.fence_proxy("async.shared", space="cta")
    return count + cfg.k_tiles


@cute.jit
def _row_scale(cfg: cutlass.Constexpr, mSS: cute.Tensor, coord0: Int32, ctid: Int32) -> Float32:
    """``rsqrt(mean(A[row]^2) + eps)`` of the tile's row ``ctid`` from A's row sums of squares
    in column blocks (added in block order); 1 for threads past the tile or rows past A."""
    row = coord0 * cfg.bm + ctid
    scale = Float32(1.0)
    if ctid < cfg.bm and row < mSS.shape[0]:
        tot = mSS[row, 0]
        for j in cutlass.range_constexpr(1, cfg.norm_blocks):
            tot = tot + mSS[row, j]
        scale = cute.math.rsqrt(tot / Float32(cfg.norm_width) + Float32(cfg.norm_eps))
    return scale


@cute.jit
def _store_partial(
    cfg: cutlass.Constexpr, mP: cute.Tensor, acc, tCcC, coord0: Int32, coord1: Int32, epi_free
):
    """Split-K partial: the fp32 accumulators of tile (coord0, coord1) to ``part[s, rows,
    cols]`` (part: (split, m, n)), rows and columns inside the tensor only.

    Straight from registers: the partials of decode-sized tiles are a few rows (the TMA store
    would stage 64), and the storer's fence and release after the consumers' barrier publish
    them. The staging buffer is still taken and given back, as every ring tile does, so the
    storer's barrier phases stay paired."""
    epi_acquire(epi_free, STORE_THREADS)
    s = coord1 % cfg.split
    r0 = coord0 * cfg.bm
    c0 = (coord1 // cfg.split) * cfg.bn
    rows = mP.shape[1]
    cols = mP.shape[2]
    for i in cutlass.range(cute.size(acc), unroll_full=True):
        r, c = tCcC[i]
        if r0 + r < rows and c0 + c < cols:
            mP[s, r0 + r, c0 + c] = acc[i]


class HopperGemmOp:
    """Mixin of the tile ops whose Hopper tile is this module's GEMM (``ops.gemm``, the grouped
    GEMM): the ring-op half of the ``TileOp`` contract, delegating to the functions above. The
    op supplies ``sm90()`` (its config, or None where the portable tile runs) and keeps its
    tensors as (A, B, ..., C)."""

    def ring_tile(self) -> RingTile | None:
        cfg = self.sm90()
        if cfg is None:
            return None
        return RingTile(cfg.k_tiles, cfg.stage_bytes, cfg.slot_bytes, cfg.epi_bytes)

    def host_args(self, tensors) -> tuple:
        """TMA descriptors (built by the launch, see ``TileOp.host_args``)."""
        cfg = self.sm90()
        if cfg is None:
            return ()
        c = tensors[len(tensors) - 1]
        if cfg.combine_k:
            c = tensors[4 + int(cfg.residual)]
        elif cfg.reduce:  # the partials: their width is B's rows
            c = tensors[cfg.part_index]
        return tma_args(cfg, tensors[0], tensors[1], c)

    def reads_async_proxy(self) -> bool:
        return self.sm90() is not None

    @cute.jit
    def device_load_independent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        load_weights(self.sm90(), tensors, word, coord1, kt, idx, bar, ring, stages, slot)

    @cute.jit
    def device_load_dependent(
        self, tensors, coord0, coord1, word, kt, idx, bar, ring, stages, slot
    ):
        load_activations(self.sm90(), tensors, coord0, coord1, kt, idx, bar, ring, stages, slot)

    @cute.jit
    def device_prefetch_l2(self, tensors, coord0, coord1, word, kt, ring, stages, slot):
        prefetch_weights(self.sm90(), tensors, word, coord1, kt, ring, stages, slot)

    @cute.jit
    def device_compute(
        self,
        tensors,
        coord0,
        coord1,
        word,
        full,
        empty,
        count,
        ring,
        stages,
        slot,
        epi,
        ctid,
        wait,
        epi_free=None,
    ):  # the word (a grouped GEMM's expert) only steers the loads
        return compute(
            self.sm90(),
            tensors,
            coord0,
            coord1,
            full,
            empty,
            count,
            ring,
            stages,
            slot,
            epi,
            ctid,
            wait,
            epi_free,
            word,
        )

    @cute.jit
    def device_store(self, tensors, coord0, coord1, epi):
        store(self.sm90(), tensors, coord0, coord1, epi)
