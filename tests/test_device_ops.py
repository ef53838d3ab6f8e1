"""Device functions of the gemm, silu_mul, rmsnorm and add tile ops, run through the tile harness.

CPU tests compile the harness kernel (one CTA per tile) for sm_90a from fake tensors with
dynamic shapes and inspect the PTX. GPU tests run it on ragged shapes against each op's torch
``reference`` on fp32-upcast inputs, with outputs poisoned by NaN beforehand.
"""

import os
import re
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass
import pytest
import torch
from cutemk.ops import AddTile, GemmTile, RmsNormTile, SiluMulTile
from cutlass import cute
from cutlass.cute.runtime import make_fake_compact_tensor

from cutemk.device.harness import compile_tile, concrete_grid
from cutemk.symbolic import sym
from cutemk.tileop import TensorSpec

HOPPER_SMEM_BYTES = 227 * 1024
COMPILE_BUDGET_S = 20.0  # generous: the largest config here compiles in ~1 s on 2 CPU cores

CUTE_DTYPE = {
    torch.float32: cutlass.Float32,
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
}
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# Relative Frobenius error vs the fp32 reference. fp32: SIMT FMA in fp32 (only the summation
# order and the approximate exp/rsqrt differ); bf16: the output rounding alone is ~2^-9.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

# Symbolic dims: one compiled kernel per op config serves every shape (layouts are dynamic).
T, N, K, H = sym("T", 4096), sym("N", 4096), sym("K", 4096), sym("H", 8192)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gemm_op(dtype, block_m, block_n, epilogue=None) -> GemmTile:
    rows_b = 2 * N if epilogue == "silu_mul" else N
    return GemmTile(
        TensorSpec((T, K), dtype), TensorSpec((rows_b, K), dtype), block_m, block_n, epilogue
    )


def silu_op(dtype, block_m, grouped=False) -> SiluMulTile:
    if grouped:  # the grouped layout: row tiles of block_m rows
        tiles = sym("TILES", 4096)
        return SiluMulTile(
            TensorSpec((tiles * block_m, 2 * N), dtype),
            TensorSpec((tiles, 2), torch.int32),
            block_m,
        )
    return SiluMulTile(TensorSpec((T, 2 * N), dtype), None, block_m)


def rms_op(dtype, block_m) -> RmsNormTile:
    return RmsNormTile(TensorSpec((T, H), dtype), TensorSpec((H,), dtype), 1e-6, block_m)


def fake_tensors(op):
    """Fake cute tensors, every extent a fresh ``cute.sym_int()``, in the device-tile order."""
    specs = {**op.input_specs(), **op.output_specs()}
    out = []
    for name in op.inputs + op.outputs:
        spec = specs[name]
        dt = cutlass.Int32 if spec.dtype == torch.int32 else CUTE_DTYPE[spec.dtype]
        shape = tuple(cute.sym_int() for _ in spec.shape)
        out.append(make_fake_compact_tensor(dt, shape, assumed_align=16))
    return out


def compile_ptx(op) -> tuple[str, float]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        compiled = compile_tile(op, fake_tensors(op), options=f"--keep-ptx --dump-dir={dump}")
    elapsed = time.perf_counter() - t0
    assert compiled.ptx, "no PTX although --keep-ptx was given"
    return compiled.ptx, elapsed


def check_entry(ptx: str) -> None:
    entries = re.findall(r"\.entry\s+(\w+)", ptx)
    assert len(entries) == 1 and entries[0].startswith("cutemk_tile"), entries
    assert "cutlass" not in entries[0].lower(), entries[0]
    assert ".target sm_90a" in ptx


# -- CPU: compile for sm_90a ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("epilogue", [None, "silu_mul"], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("block", [(64, 64), (16, 32), (24, 40)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_gemm_device_tile_compiles(dtype, epilogue, block):
    op = gemm_op(dtype, *block, epilogue)
    ptx, elapsed = compile_ptx(op)
    assert elapsed < COMPILE_BUDGET_S, f"compile took {elapsed:.1f} s"
    check_entry(ptx)
    # fp32 stays on CUDA-core FMA (fp32 accuracy); 16-bit inputs use warp-level tensor cores.
    if dtype == torch.float32:
        assert "mma.sync" not in ptx and re.search(r"\bfma\.rn\.f32\b", ptx)
    else:
        assert re.search(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b", ptx)
    assert re.search(r"\b(?:bar|barrier)\.sync\b", ptx)  # the k-slices go through shared memory


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("epilogue", [None, "silu_mul"], ids=["plain", "silu_mul"])
def test_gemm_smem_fits_hopper_up_to_128x128(dtype, epilogue):
    op = gemm_op(dtype, 128, 128, epilogue)
    assert 0 < op.device_smem_bytes() <= HOPPER_SMEM_BYTES


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_silu_mul_device_tile_compiles(dtype, grouped):
    op = silu_op(dtype, 64, grouped)
    assert op.device_smem_bytes() == 0
    ptx, elapsed = compile_ptx(op)
    assert elapsed < COMPILE_BUDGET_S, f"compile took {elapsed:.1f} s"
    check_entry(ptx)
    assert not re.search(
        r"\b(?:bar|barrier)\.sync\b", ptx
    )  # elementwise: no shared memory, no barrier


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rmsnorm_device_tile_compiles(dtype):
    op = rms_op(dtype, 16)
    assert op.device_smem_bytes() == 0
    ptx, elapsed = compile_ptx(op)
    assert elapsed < COMPILE_BUDGET_S, f"compile took {elapsed:.1f} s"
    check_entry(ptx)
    assert "shfl.sync.bfly" in ptx  # per-warp reduction in registers
    assert not re.search(r"\b(?:bar|barrier)\.sync\b", ptx)


@pytest.mark.parametrize("hidden,before", [(2048, 16), (4096, 16)])
def test_rmsnorm_loads_x_and_a_one_batch_weight_together(hidden, before):
    """At 2048 bf16 columns (8 vectors a lane) the weight's loads go out with x's, before the
    row's reduction: one round trip a row, not two. At 4096 (16 vectors a lane, two batches of
    the weight) the weight still comes in batches after the reduction."""
    op = RmsNormTile(
        TensorSpec((T, hidden), torch.bfloat16), TensorSpec((hidden,), torch.bfloat16), 1e-6, 4
    )
    ptx, _ = compile_ptx(op)
    body = ptx[ptx.index(".entry") :]
    first_shuffle = body.index("shfl.sync.bfly")
    loads = re.findall(r"ld\.global\S*\.v4", body)
    assert len(re.findall(r"ld\.global\S*\.v4", body[:first_shuffle])) == before
    assert len(loads) == 2 * hidden // 256


def add_op(dtype, block_m, width=None) -> AddTile:
    """A residual add over ``width`` columns (static), or the symbolic width H."""
    spec = TensorSpec((T, H if width is None else width), dtype)
    return AddTile(spec, spec, block_m)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_device_tile_moves_16_byte_vectors(dtype):
    """At a static width the add loads and stores 16-byte vectors, the loads of a batch ahead
    of its stores; at a width known only at run time it goes element by element."""
    ptx, _ = compile_ptx(add_op(dtype, 4, 2048))
    check_entry(ptx)
    body = ptx[ptx.index(".entry") :]
    loads = [m.start() for m in re.finditer(r"ld\.global\S*\.v4\.(?:b32|u32|f32)", body)]
    stores = [m.start() for m in re.finditer(r"st\.global\S*\.v4\.(?:b32|u32|f32)", body)]
    # 4 rows x 2048 columns over 128 threads: 8 (bf16) or 16 (fp32) vectors of each input a
    # thread, in batches of 8: all of a batch's 16 loads come before its first store
    assert len(loads) == (16 if dtype == torch.bfloat16 else 32), len(loads)
    assert len(stores) == len(loads) // 2
    assert max(loads[:16]) < min(stores)
    ptx, _ = compile_ptx(add_op(dtype, 4))
    assert not re.search(r"\.v4\.", ptx[ptx.index(".entry") :])


# -- GPU: run against the torch reference ------------------------------------------------------
_COMPILED: dict = {}


def run_and_check(op, env, inputs: dict[str, torch.Tensor], dtype) -> None:
    """Run every tile of ``op`` on the GPU and compare with ``op.reference`` on fp32 inputs."""
    outs = {
        name: torch.full(spec.concrete(env), float("nan"), dtype=spec.dtype, device="cuda")
        for name, spec in op.output_specs().items()
    }
    tensors = [inputs[n] for n in op.inputs] + [outs[n] for n in op.outputs]
    if op not in _COMPILED:
        _COMPILED[op] = compile_tile(op, tensors)
    grid = concrete_grid(op, env)
    _COMPILED[op](tensors, grid)
    torch.cuda.synchronize()

    ref = {n: (t.float() if t.is_floating_point() else t) for n, t in inputs.items()}
    ref.update({n: torch.zeros(t.shape, device="cuda") for n, t in outs.items()})
    for i in range(grid[0]):
        for j in range(grid[1] if len(grid) > 1 else 1):
            op.reference((i, j)[: len(grid)], env, ref)
    for name, got in outs.items():
        assert not torch.isnan(got).any(), f"{name}: NaN left in the written region, env={env}"
        want = ref[name]
        err = (got.float() - want).norm() / want.norm().clamp_min(1e-30)
        assert err < REL_TOL[dtype], f"{name}: rel err {err:.2e} (env={env}, {op.describe()})"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("epilogue", [None, "silu_mul"], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("block", [(64, 64), (16, 32), (24, 40)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_gemm_device_tile_matches_reference(dtype, epilogue, block):
    torch.manual_seed(0)
    op = gemm_op(dtype, *block, epilogue)
    nb = 2 if epilogue == "silu_mul" else 1
    for m in (1, 7, 100):
        for n, k in ((40, 24), (96, 100), (130, 1)):
            env = {"T": m, "N": n, "K": k}
            a = torch.randn(m, k, device="cuda").to(dtype)
            b = (torch.randn(nb * n, k, device="cuda") / k**0.5).to(dtype)
            run_and_check(op, env, {"a": a, "b": b}, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "dtype,block,epilogue",
    [
        (torch.float16, (64, 64), "silu_mul"),
        (torch.float32, (128, 128), "silu_mul"),  # 50 KB of shared memory: above the 48 KB default
        (torch.bfloat16, (128, 128), "silu_mul"),
        (torch.bfloat16, (128, 128), None),
    ],
    ids=["fp16-64x64-silu_mul", "fp32-128x128-silu_mul", "bf16-128x128-silu_mul", "bf16-128x128"],
)
def test_gemm_device_tile_large_tiles_and_fp16(dtype, block, epilogue):
    torch.manual_seed(0)
    op = gemm_op(dtype, *block, epilogue)
    nb = 2 if epilogue == "silu_mul" else 1
    for m, n, k in ((1, 130, 100), (200, 300, 257)):
        env = {"T": m, "N": n, "K": k}
        a = torch.randn(m, k, device="cuda").to(dtype)
        b = (torch.randn(nb * n, k, device="cuda") / k**0.5).to(dtype)
        run_and_check(op, env, {"a": a, "b": b}, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
@pytest.mark.parametrize("block_m", [64, 3])
def test_silu_mul_device_tile_matches_reference(dtype, grouped, block_m):
    torch.manual_seed(0)
    op = silu_op(dtype, block_m, grouped)
    for rows in (1, 7, 100):
        for n in (1, 200, 513):
            env = {"T": rows, "N": n}
            if grouped:  # every row block exists (existence is the caller's check)
                tiles = -(-rows // block_m)
                env["TILES"] = tiles
                rows = tiles * block_m
            inputs = {"h": torch.randn(rows, 2 * n, device="cuda").to(dtype)}
            if grouped:
                inputs["tile_info"] = torch.zeros(tiles, 2, dtype=torch.int32, device="cuda")
            run_and_check(op, env, inputs, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_m", [16, 3])
def test_rmsnorm_device_tile_matches_reference(dtype, block_m):
    torch.manual_seed(0)
    op = rms_op(dtype, block_m)
    for rows in (1, 7, 100):
        for hidden in (1, 64, 1000):
            env = {"T": rows, "H": hidden}
            x = (torch.randn(rows, hidden, device="cuda") * 3).to(dtype)
            w = torch.randn(hidden, device="cuda").to(dtype)
            run_and_check(op, env, {"x": x, "weight": w}, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("width", [2048, 40, None], ids=["w2048", "w40", "dynamic"])
@pytest.mark.parametrize("block_m", [4, 3])
def test_add_device_tile_matches_reference(dtype, width, block_m):
    torch.manual_seed(0)
    op = add_op(dtype, block_m, width)
    for rows in (1, 5, 13):
        for hidden in (width,) if width else (8, 1000):
            env = {"T": rows} if width else {"T": rows, "H": hidden}
            a = torch.randn(rows, hidden, device="cuda").to(dtype)
            b = (torch.randn(rows, hidden, device="cuda") * 4).to(dtype)
            run_and_check(op, env, {"a": a, "b": b}, dtype)
