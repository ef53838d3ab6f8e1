"""Standalone kernel that runs one tile op's ``device_tile`` for every tile of its grid.

It is the op-level test bench of the megakernel contract: one CTA of ``op.simt_threads`` threads per
tile, ``coord = blockIdx``, the op's ``device_smem_bytes()`` of dynamic shared memory handed over
as a pointer, tensors in ``op.inputs + op.outputs`` order. Nothing here is on the megakernel's
path; it exists so a device function can be compiled (CPU, sm_90a) and checked against the op's
torch reference (GPU) in isolation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import torch
from cutlass import Int32, cute
from cutlass.cute.runtime import from_dlpack, make_fake_stream

from cutemk.symbolic import evaluate
from cutemk.tileop import TileOp


SMEM_ALIGN = 1024
"""Byte alignment of the scratch handed to ``device_tile`` (128-byte swizzled TMA tiles need
1024)."""


class TileHarness:
    """Launch ``op.device_tile`` on a grid of (g0, g1) CTAs, one tile each."""

    def __init__(self, op: TileOp) -> None:
        self.op = op
        # Never 0: the contract always passes a pointer, even to ops that ignore it.
        self.smem_bytes = max(int(op.device_smem_bytes()), 16)

    @cute.kernel
    def kernel(self, tensors: tuple, extra: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        smem_ptr = smem.allocate_array(cutlass.Uint8, self.smem_bytes, byte_alignment=SMEM_ALIGN)
        self.op.device_tile(tensors + extra, bidx, bidy, tidx, smem_ptr)

    @cute.jit
    def launch(self, tensors: tuple, g0: Int32, g1: Int32, stream: cuda.CUstream):
        self.kernel(tensors, self.op.host_args(tensors)).launch(
            grid=(g0, g1, 1), block=(self.op.simt_threads, 1, 1), stream=stream
        )


# The DSL prefixes generated symbols with "cutlass_"; cutemk names its own kernels (a kernel name containing "cutlass" was reported to trigger heavy ptxas spilling).
TileHarness.kernel.set_name_prefix("cutemk_tile", remove_cutlass_symbol=True)
TileHarness.launch.set_name_prefix("cutemk_tile_launch", remove_cutlass_symbol=True)


def as_cute_tensor(t: Any) -> Any:
    """A torch tensor as a cute.Tensor with a fully dynamic row-major layout; others pass through.

    Dynamic layouts make one compiled kernel serve every shape (the token count is a runtime
    value in the megakernel too).
    """
    if isinstance(t, torch.Tensor):
        return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.ndim - 1)
    return t


@dataclass
class CompiledTile:
    """A compiled harness kernel; call it with the tensors and the concrete grid."""

    op: TileOp
    fn: Any
    ptx: str | None

    def __call__(self, tensors: Sequence[Any], grid: Sequence[int], stream: Any = None) -> None:
        g = tuple(int(x) for x in grid) + (1,) * (2 - len(grid))
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        self.fn(tuple(as_cute_tensor(t) for t in tensors), Int32(g[0]), Int32(g[1]), stream)


def compile_tile(op: TileOp, tensors: Sequence[Any], options: str = "") -> CompiledTile:
    """Compile the harness for ``op``; ``tensors`` are torch tensors or fake cute tensors.

    ``options`` goes to ``cute.compile`` (e.g. ``"--keep-ptx"`` to fill ``ptx``).
    """
    names = op.inputs + op.outputs + tuple(f"{v}@peers" for v in op.peer_values)
    if len(tensors) != len(names):
        raise ValueError(
            f"{op.name}: expected {len(names)} tensors ({', '.join(names)}), got {len(tensors)}"
        )
    args = tuple(as_cute_tensor(t) for t in tensors)
    fn = cute.compile(
        TileHarness(op).launch, args, Int32(1), Int32(1), make_fake_stream(), options=options
    )
    return CompiledTile(op, fn, getattr(fn, "__ptx__", None))


def concrete_grid(op: TileOp, env: Mapping[str, int] | None = None) -> tuple[int, ...]:
    """The op's task grid with every symbolic dim bound by ``env``."""
    return tuple(evaluate(g, env or {}) for g in op.grid())


def run_tile_op(
    op: TileOp, tensors: Sequence[torch.Tensor], env: Mapping[str, int] | None = None
) -> CompiledTile:
    """Compile and run the harness on live CUDA tensors (every tile once); returns the kernel."""
    compiled = compile_tile(op, tensors)
    compiled(tensors, concrete_grid(op, env))
    return compiled
