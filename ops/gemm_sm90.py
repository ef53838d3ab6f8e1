"""Hopper (sm_90a) device path of the GEMM tile: TMA loads into a shared-memory ring, wgmma.

One task computes one ``(bm, bn)`` tile of ``C = A @ B^T`` with the CTA's single warpgroup
(the megakernel's 128 threads):

- **Host** (``tma_args``, traced into the launch function): one TMA descriptor for A and one
  for B (two with the ``silu_mul`` epilogue: the gate and up halves of ``[W_gate; W_up]``, so
  each half is bounded by its own descriptor). Descriptors are built from the launch's tensors,
  so a token count below the maximum only changes A's row extent; rows past it load as zeros.
- **Device** (``device_tile``): warp 0 keeps ``stages`` k-slices of A and B in flight through
  a ``PipelineTmaAsync`` ring (full barriers count TMA bytes, empty barriers count the four
  warps' releases); the warpgroup issues ``wgmma`` on each landed slice, keeps one batch in
  flight, releases the slice of the batch before, and warp 0 refills that slot. The fp32
  accumulator is written to C straight from registers, masked at the tensor edges.

Memory ordering inside the megakernel: TMA reads global memory through the async proxy, while
the tiles that produced A wrote it with ordinary stores. Every thread therefore fences the
generic and async proxies (``fence.proxy.async``) before the ring is set up, after the task's
events were acquired; the megakernel also fences after each task that may feed such a reader.
The ring's barriers are re-initialised for every task (all of its phases completed by the end
of the previous one), so no pipeline state lives across tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Float16, Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cutemk.device.config import NUM_WARPS, WARP_SIZE

BLOCK_K = 64
"""k-slice per pipeline stage: 64 bf16 = one 128-byte swizzle row."""

SMEM_BUDGET = 200 * 1024
"""Shared memory the ring may take (the megakernel keeps a few KB for its own state)."""

MAX_STAGES = 4
MAX_ACC_ELEMS = 128 * 128
"""Accumulator elements per tile (all gemm outputs): 128 fp32 registers per thread."""

_CUTE_DTYPES = {torch.bfloat16: BFloat16, torch.float16: Float16}


@dataclass(frozen=True)
class Sm90GemmConfig:
    """Compile-time shape of the Hopper tile: ``bm x bn`` outputs, ``n_b`` B tiles (2 when the
    gate and up products are fused), ``stages`` k-slices in flight."""

    bm: int
    bn: int
    n_b: int
    stages: int
    dtype: torch.dtype

    @property
    def stage_bytes(self) -> int:
        return (self.bm + self.n_b * self.bn) * BLOCK_K * self.dtype.itemsize

    @property
    def ring_bytes(self) -> int:
        return self.stages * self.stage_bytes

    def smem_bytes(self) -> int:
        return self.ring_bytes + 2 * self.stages * 8  # + full/empty mbarriers


def sm90_config(
    dtype: torch.dtype, block_m: int, block_n: int, k, fused: bool
) -> Sm90GemmConfig | None:
    """The Hopper tile for these parameters, or None where the wgmma path does not apply
    (fp32, a block shape wgmma does not tile, or a K whose rows TMA cannot address)."""
    if dtype not in _CUTE_DTYPES:
        return None
    n_b = 2 if fused else 1
    if block_m not in (64, 128) or block_n % 16 or not 16 <= block_n <= 256:
        return None
    if block_m * block_n * n_b > MAX_ACC_ELEMS:
        return None
    # TMA needs 16-byte aligned row strides; K must be known to guarantee it
    if not isinstance(k, int) or (k * dtype.itemsize) % 16:
        return None
    stage_bytes = (block_m + n_b * block_n) * BLOCK_K * dtype.itemsize
    stages = min(MAX_STAGES, SMEM_BUDGET // stage_bytes)
    if stages < 2:
        return None
    return Sm90GemmConfig(block_m, block_n, n_b, stages, dtype)


def _smem_layouts(cfg: Sm90GemmConfig):
    ab = _CUTE_DTYPES[cfg.dtype]
    tile = (cfg.bm, cfg.bn, BLOCK_K)
    a = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, ab, cfg.stages)
    b = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, ab, cfg.stages)
    return a, b


def _tiled_mma(cfg: Sm90GemmConfig):
    ab = _CUTE_DTYPES[cfg.dtype]
    return sm90_utils.make_trivial_tiled_mma(
        ab, ab, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(64, cfg.bn)
    )


def tma_args(cfg: Sm90GemmConfig, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor) -> tuple:
    """Host side (inside a ``@cute.jit`` launch): ``(atom_a, tma_a, atom_b, tma_b[, atom_u,
    tma_u])``. mA: (m, k); mB: (n, k) or (2n, k) = [W_gate; W_up]; mC: (m, n)."""
    a_layout, b_layout = _smem_layouts(cfg)
    op = cpasync.CopyBulkTensorTileG2SOp()
    a_one = cute.slice_(a_layout, (None, None, 0))
    b_one = cute.slice_(b_layout, (None, None, 0))
    atom_a, tma_a = cpasync.make_tiled_tma_atom(op, mA, a_one, (cfg.bm, BLOCK_K))
    if cutlass.const_expr(cfg.n_b == 1):
        atom_b, tma_b = cpasync.make_tiled_tma_atom(op, mB, b_one, (cfg.bn, BLOCK_K))
        return atom_a, tma_a, atom_b, tma_b
    n = mC.shape[1]
    half = cute.make_layout((n, mB.shape[1]), stride=mB.stride)
    gate = cute.make_tensor(mB.iterator, half)
    up = cute.make_tensor(mB.iterator + n * mB.stride[0], half)
    atom_b, tma_b = cpasync.make_tiled_tma_atom(op, gate, b_one, (cfg.bn, BLOCK_K))
    atom_u, tma_u = cpasync.make_tiled_tma_atom(op, up, b_one, (cfg.bn, BLOCK_K))
    return atom_a, tma_a, atom_b, tma_b, atom_u, tma_u


@cute.jit
def device_tile(
    cfg: cutlass.Constexpr,
    tensors,
    coord0: Int32,
    coord1: Int32,
    tidx: Int32,
    smem_ptr,
):
    """Tile (coord0, coord1) of C. ``tensors`` = (mA, mB, mC) + ``tma_args(...)``;
    ``smem_ptr`` is 1024-byte aligned scratch of ``cfg.smem_bytes()``."""
    fused = cfg.n_b == 2
    mC = tensors[2]
    atom_a, tma_a, atom_b, tma_b = tensors[3], tensors[4], tensors[5], tensors[6]
    ab = _CUTE_DTYPES[cfg.dtype]
    a_layout, b_layout = _smem_layouts(cfg)
    a_bytes = cfg.stages * cfg.bm * BLOCK_K * cfg.dtype.itemsize
    b_bytes = cfg.stages * cfg.bn * BLOCK_K * cfg.dtype.itemsize
    sA = cute.make_tensor(cute.recast_ptr(smem_ptr, a_layout.inner, dtype=ab), a_layout.outer)
    sB = cute.make_tensor(
        cute.recast_ptr(smem_ptr + a_bytes, b_layout.inner, dtype=ab), b_layout.outer
    )
    sU = sB  # the up tiles; an alias of sB (never read) without the fused epilogue
    if cutlass.const_expr(fused):
        sU = cute.make_tensor(
            cute.recast_ptr(smem_ptr + a_bytes + b_bytes, b_layout.inner, dtype=ab),
            b_layout.outer,
        )
    bars = cute.recast_ptr(smem_ptr + cfg.ring_bytes, dtype=Int64)

    # A's producers wrote with generic stores (and this scratch may hold another op's generic
    # writes): order both before the async-proxy TMA writes and wgmma reads below.
    cute.arch.fence_proxy("async")
    ring = pipeline.PipelineTmaAsync.create(
        num_stages=cfg.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_WARPS),
        tx_count=cfg.stage_bytes,
        barrier_storage=bars,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
    )

    # (bm, BLOCK_K, k_tiles) and (bn, BLOCK_K, k_tiles) coordinate tiles of this task
    gA = cute.local_tile(tma_a, (cfg.bm, BLOCK_K), (coord0, None))
    gB = cute.local_tile(tma_b, (cfg.bn, BLOCK_K), (coord1, None))
    one = cute.make_layout(1)
    tAsA, tAgA = cpasync.tma_partition(
        atom_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
    )
    tBsB, tBgB = cpasync.tma_partition(
        atom_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
    )
    tUsU, tUgU = tBsB, tBgB
    atom_u = atom_b
    if cutlass.const_expr(fused):
        atom_u = tensors[7]
        gU = cute.local_tile(tensors[8], (cfg.bn, BLOCK_K), (coord1, None))
        tUsU, tUgU = cpasync.tma_partition(
            atom_u, 0, one, cute.group_modes(sU, 0, 2), cute.group_modes(gU, 0, 2)
        )

    tiled_mma = _tiled_mma(cfg)
    wg_mma = tiled_mma.get_slice(0)  # one warpgroup: its smem descriptors
    tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
    tCrU = tiled_mma.make_fragment_B(wg_mma.partition_B(sU))
    tCcC = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((cfg.bm, cfg.bn)))
    acc = cute.make_rmem_tensor(tCcC.shape, Float32)
    acc_up = cute.make_rmem_tensor(tCcC.shape, Float32)
    acc.fill(0.0)
    if cutlass.const_expr(fused):
        acc_up.fill(0.0)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

    k_tiles = cute.size(gA, mode=[2])
    warp = cute.arch.make_warp_uniform(tidx // WARP_SIZE)
    load = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
    free = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)

    if warp == 0:
        for _ in cutlass.range(cute.min(cfg.stages, k_tiles), unroll=1):
            _load_slice(
                ring, load, atom_a, tAgA, tAsA, atom_b, tBgB, tBsB, atom_u, tUgU, tUsU, fused
            )
            load.advance()

    for kt in cutlass.range(k_tiles, unroll=1):
        ring.consumer_wait(read)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            slot = (None, None, kb, read.index)
            cute.gemm(tiled_mma, acc, tCrA[slot], tCrB[slot], acc)
            if cutlass.const_expr(fused):
                cute.gemm(tiled_mma, acc_up, tCrA[slot], tCrU[slot], acc_up)
        warpgroup.commit_group()
        warpgroup.wait_group(1)  # the batch before this one has read its slot
        read.advance()
        if kt > 0:
            # every warp frees slice kt-1, then warp 0 refills that slot: a refill is only
            # issued after its release (waiting for one before it would deadlock warp 0
            # against the other warps, which need warp 0 for the next warpgroup-wide wgmma)
            ring.consumer_release(free)
            free.advance()
            if warp == 0 and load.count < k_tiles:
                _load_slice(
                    ring, load, atom_a, tAgA, tAsA, atom_b, tBgB, tBsB, atom_u, tUgU, tUsU, fused
                )
                load.advance()
    warpgroup.wait_group(0)

    m = mC.shape[0]
    n = mC.shape[1]
    row0 = coord0 * cfg.bm
    col0 = coord1 * cfg.bn
    for i in cutlass.range(cute.size(acc), unroll_full=True):
        r, c = tCcC[i]
        if row0 + r < m and col0 + c < n:
            v = acc[i]
            if cutlass.const_expr(fused):
                v = v / (Float32(1.0) + cute.math.exp(-v)) * acc_up[i]
            mC[row0 + r, col0 + c] = v.to(mC.element_type)


def _load_slice(ring, state, atom_a, tAgA, tAsA, atom_b, tBgB, tBsB, atom_u, tUgU, tUsU, fused):
    """Warp 0: wait for the slot to be free, arm its full barrier, issue the TMA copies of one
    k-slice (A, B and, fused, the up half of B)."""
    ring.producer_acquire(state)
    bar = ring.producer_get_barrier(state)
    k, s = state.count, state.index
    cute.copy(atom_a, tAgA[(None, k)], tAsA[(None, s)], tma_bar_ptr=bar)
    cute.copy(atom_b, tBgB[(None, k)], tBsB[(None, s)], tma_bar_ptr=bar)
    if fused:
        cute.copy(atom_u, tUgU[(None, k)], tUsU[(None, s)], tma_bar_ptr=bar)
