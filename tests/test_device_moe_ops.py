"""Device functions of the MoE tile ops (topk_softmax, moe_route, moe_grouped_gemm, moe_combine).

CPU: each op's ``device_tile`` is compiled for sm_90a inside the one-tile-per-CTA harness
(``cutemk.device.harness``) with fake tensors whose token-derived extents are dynamic, and the
PTX is checked for what the design promises (barriers, shared memory, FMA, conversions).
GPU: each op runs over its whole grid against its torch ``reference`` (fp32, on the CPU), with
fresh random inputs, poisoned outputs and routings that leave an expert empty or send every
token to one expert. The MoE inputs of later ops come from the torch references of earlier ones.
"""

import itertools
import os
import re
import time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cuda.bindings.driver as cuda
import cutlass
import pytest
import torch
from cutlass import Int32, cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

import cutemk as mk
from cutemk import ops
from cutemk.device.harness import as_cute_tensor, compile_tile, concrete_grid
from cutemk.symbolic import Expr, evaluate
from cutemk.tileop import TensorSpec, TileOp

E, TOP_K, BM, BN = 8, 2, 16, 32
HIDDEN, INTER = 40, 24  # K not a multiple of the 32-wide k-slice; partial column blocks
TOKENS = (1, 7, 300)
ROUTINGS = ("random", "empty_expert", "one_expert")
INT_POISON = -777
CUTE_DTYPE = {
    torch.float32: cutlass.Float32,
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.int32: Int32,
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FLOATS = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


# -- op builders (token count symbolic, as in the MoE graph) ---------------------------------
def _sym_t():
    return mk.sym("T", max=4096)


def _topk(dtype):
    return ops.topk_softmax(TensorSpec((_sym_t(), E), dtype), k=TOP_K, block_m=BM)


def _topk_split(logits_dtype):
    """The router's split-K partials (4, T, E) fp32 summed by the top-k."""
    spec = TensorSpec((SPLITS, _sym_t(), E), torch.float32)
    return ops.topk_softmax(spec, k=TOP_K, block_m=BM, logits_dtype=logits_dtype)


SPLITS = 4


def _route():
    return ops.moe_route(TensorSpec((_sym_t(), TOP_K), torch.int32), num_experts=E, block_m=BM)


def _route_specs():
    return _route().output_specs()


def _grouped_gemm(dtype, gathered: bool):
    s = _route_specs()
    tiles = s["tile_info"].shape[0]
    if gathered:  # gate/up: token-major x gathered through row_token
        x = TensorSpec((_sym_t(), HIDDEN), dtype)
        w = TensorSpec((E, 2 * INTER, HIDDEN), dtype)
        return ops.moe_grouped_gemm(x, w, s["tile_info"], s["row_token"], block_m=BM, block_n=BN)
    x = TensorSpec((tiles * BM, INTER), dtype)  # down: x already in the padded layout
    w = TensorSpec((E, HIDDEN, INTER), dtype)
    return ops.moe_grouped_gemm(x, w, s["tile_info"], block_m=BM, block_n=BN)


def _combine(dtype, block_n=BN):
    s = _route_specs()
    rows = TensorSpec((s["tile_info"].shape[0] * BM, HIDDEN), dtype)
    weights = TensorSpec((_sym_t(), TOP_K), torch.float32)
    return ops.moe_combine(rows, weights, s["slot_row"], block_m=BM, block_n=block_n)


def _permute(dtype, hidden=HIDDEN):
    s = _route_specs()
    x = TensorSpec((_sym_t(), hidden), dtype)
    return ops.moe_permute(x, s["tile_info"], s["row_token"], block_m=BM)


def _specs(op: TileOp) -> list[TensorSpec]:
    ins, outs = op.input_specs(), op.output_specs()
    return [ins[n] for n in op.inputs] + [outs[n] for n in op.outputs]


# -- CPU: compile for sm_90a ------------------------------------------------------------------
def _fake(spec: TensorSpec):
    """A fake compact tensor: every symbolic extent (T and what derives from it) is dynamic."""
    shape = tuple(cute.sym_int() if isinstance(d, Expr) else int(d) for d in spec.shape)
    return make_fake_compact_tensor(CUTE_DTYPE[spec.dtype], shape, assumed_align=16)


def _compile_ptx(op: TileOp, dump_dir: Path) -> str:
    t0 = time.perf_counter()
    compiled = compile_tile(
        op, [_fake(s) for s in _specs(op)], options=f"--keep-ptx --dump-dir={dump_dir}"
    )
    elapsed = time.perf_counter() - t0
    assert elapsed < 30, f"{op.name}: compile took {elapsed:.1f} s"
    assert compiled.ptx, "no PTX although --keep-ptx was given"
    entries = re.findall(r"\.entry\s+(\w+)", compiled.ptx)
    assert len(entries) == 1 and "cutlass" not in entries[0].lower(), entries
    return compiled.ptx


def _count(pattern: str, ptx: str) -> int:
    return len(re.findall(pattern, ptx))


@FLOATS
def test_topk_softmax_compiles(tmp_path, dtype):
    ptx = _compile_ptx(_topk(dtype), tmp_path)
    assert _count(r"\bex2\.approx", ptx) >= 1  # softmax exp
    assert _count(r"\b(?:bar|barrier)\.sync\b", ptx) == 0  # thread-per-token: no barrier, no smem
    assert _count(r"\bst\.global\.[bsu]32\b", ptx) >= 2  # weights and ids


def test_topk_softmax_over_partials_compiles(tmp_path):
    ptx = _compile_ptx(_topk_split(torch.bfloat16), tmp_path)
    assert _count(r"\bld\.global\.[bf]32\b", ptx) >= SPLITS  # every partial of a logit
    # a pick: the largest key, then the lowest id holding it, one warp reduction each
    assert _count(r"\bredux\.sync\.max\.s32\b", ptx) == 1
    assert _count(r"\bredux\.sync\.min\.s32\b", ptx) == 1
    assert _count(r"\bcvt\.rn\.bf16\.f32\b", ptx) >= 1  # the sums rounded as bf16 logits
    assert _count(r"\b(?:bar|barrier)\.sync\b", ptx) == 0


@pytest.mark.parametrize("experts", [128, 40])
def test_topk_softmax_loads_a_row_in_one_round_trip(tmp_path, experts):
    """A lane's logits, every split partial of each, are loaded with no branch between them
    (one round trip to memory a row: they were four at 128 experts, a branch a register)."""
    splits, per_lane = 8, -(-experts // 32)
    spec = TensorSpec((splits, _sym_t(), experts), torch.float32)
    op = ops.topk_softmax(spec, k=TOP_K, block_m=BM, logits_dtype=torch.bfloat16)
    body = _compile_ptx(op, tmp_path)
    body = body[body.index(".entry") :]
    loads = [m.start() for m in re.finditer(r"\bld\.global\.", body)]
    assert len(loads) == splits * per_lane
    assert not re.search(r"\bbra\b", body[loads[0] : loads[-1]])


def test_moe_route_compiles(tmp_path):
    ptx = _compile_ptx(_route(), tmp_path)
    # zero -> count -> scan over chunks -> scan over experts -> placement: four CTA barriers
    assert _count(r"\b(?:bar|barrier)\.sync\b", ptx) == 4
    # small code (one SM runs it, its instructions often fetched from HBM): a token's k ids
    # loaded once in each of the two passes, no unrolled copies of the passes
    assert _count(r"\bld\.global\.", ptx) == 2 * TOP_K, _count(r"\bld\.global\.", ptx)
    assert _count(r"\bld\.shared\.", ptx) >= 3 and _count(r"\bst\.shared\.", ptx) >= 3
    # per-thread smem rows: no atomics anywhere
    assert _count(r"\b(atom|red)\.", ptx) == 0


@FLOATS
@pytest.mark.parametrize("gathered", [True, False], ids=["gather", "padded"])
def test_moe_grouped_gemm_compiles(tmp_path, dtype, gathered):
    ptx = _compile_ptx(_grouped_gemm(dtype, gathered), tmp_path)
    # smem staging: one barrier after the row indices, two per k-slice
    assert _count(r"\b(?:bar|barrier)\.sync\b", ptx) == 3
    # block_m*block_n/NUM_THREADS = 4 accumulators x 32-wide k-slice, unrolled
    assert _count(r"\bfma\.rn\.f32\b", ptx) >= 4 * 32
    assert _count(r"\bld\.shared\.", ptx) >= 2 * 32
    if dtype == torch.bfloat16:
        assert re.search(r"\bcvt\.rn\.bf16\.f32\b", ptx), "fp32 -> bf16 epilogue conversion"


@FLOATS
@pytest.mark.parametrize("block_n", [BN, 20], ids=["16B_words", "8B_words"])
def test_moe_combine_compiles(tmp_path, dtype, block_n):
    op = _combine(dtype, block_n)
    batch = op._word_unroll() * TOP_K  # gathers a thread issues at once
    ptx = _compile_ptx(op, tmp_path)
    # no barrier and no shared memory: each thread loads the slot rows and weights it
    # gathers with itself (no hand-over between the body's warpgroups)
    assert _count(r"\b(?:bar|barrier)(\.cta)?\.(sync|arrive)\b", ptx) == 0
    assert op.device_smem_bytes() == 0 and not re.search(r"\bs[td]\.shared", ptx)
    assert _count(r"\bfma\.rn\.f32\b|\bmul\.(rn\.)?f32\b", ptx) >= TOP_K
    if dtype == torch.bfloat16:
        # 16-bit rows move as words of 8 columns (H and block_n multiples of 8: 16 bytes) or
        # of 4 (8 bytes): vector loads and stores, packed casts
        if block_n % 8 == 0:
            assert op._words() == 8
            assert _count(r"\bld\.global\.v4\.b32\b", ptx) >= batch
            assert _count(r"\bst\.global\.v4\.b32\b", ptx) >= 1
        else:
            assert op._words() == 4
            assert _count(r"\bld\.global\.v4\.b16\b", ptx) >= batch
            assert _count(r"\bst\.global\.v2\.b32\b", ptx) >= 1
        assert re.search(r"\bcvt\.rn\.bf16x2\.f32\b", ptx)


@pytest.mark.parametrize(
    "dtype, hidden, word",
    [(torch.bfloat16, 40, 16), (torch.bfloat16, 36, 8), (torch.float32, 3, 4)],
    ids=["16B_words", "8B_words", "elements"],
)
def test_moe_permute_moves_the_widest_words_its_rows_allow(tmp_path, dtype, hidden, word):
    """A row of a whole number of 16-byte words is copied as 16-byte words (one vector load
    and store each, ``UNROLL_BYTES`` of loads in flight a thread before the stores), of 8-byte words as
    8-byte ones, else an element at a time."""
    op = _permute(dtype, hidden)
    assert op._word() == word
    ptx = _compile_ptx(op, tmp_path)
    vec = {16: r"\b(ld|st)\.global\.v(2\.b64|4\.b32)\b", 8: r"\b(ld|st)\.global\.(b64|v2\.b32)\b"}
    if word in vec:
        assert _count(vec[word], ptx) >= 2 * op._unroll()
    # each thread loads its words' source rows itself: no staging, no barrier
    assert op.device_smem_bytes() == 0 and not re.search(r"\bs[td]\.shared", ptx)
    assert _count(r"\b(?:bar|barrier)(\.cta)?\.(sync|arrive)\b", ptx) == 0


@FLOATS
def test_moe_combine_issues_a_batch_of_gathers_at_once(tmp_path, dtype):
    """A thread's gathers of a batch (UNROLL outputs x top-k rows) go out with no branch
    between them, the sums after: they were a branch apiece (the NaN for a slot with no row
    tested after each load), one round trip each."""
    from cutemk.ops.moe_combine import UNROLL

    body = _compile_ptx(_combine(dtype), tmp_path)
    body = body[body.index(".entry") :]
    longest = run = 0
    for m in re.finditer(r"\bld\.global\.|\bbra\b", body):
        run = run + 1 if m.group().startswith("ld") else 0
        longest = max(longest, run)
    assert longest >= UNROLL * TOP_K - 1, longest


class _ExistsHarness:
    """flags[i] = op.device_exists(tensors, i, 0): one CTA, one thread per row tile."""

    def __init__(self, op: TileOp) -> None:
        self.op = op

    @cute.kernel
    def kernel(self, tensors: tuple, mFlags: cute.Tensor):  # mFlags: (tiles,) int32
        tidx, _, _ = cute.arch.thread_idx()
        for i in range(tidx, mFlags.shape[0], 128):
            flag = Int32(0)
            if self.op.device_exists(tensors, i, Int32(0)):
                flag = Int32(1)
            mFlags[i] = flag

    @cute.jit
    def launch(self, tensors: tuple, mFlags: cute.Tensor, stream):
        self.kernel(tensors, mFlags).launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)


_ExistsHarness.kernel.set_name_prefix("cutemk_exists", remove_cutlass_symbol=True)
_ExistsHarness.launch.set_name_prefix("cutemk_exists_launch", remove_cutlass_symbol=True)


def _compile_exists(op: TileOp, tensors, flags):
    return cute.compile(
        _ExistsHarness(op).launch, tuple(tensors), flags, make_fake_stream(), options=""
    )


def test_moe_grouped_gemm_device_exists_compiles():
    op = _grouped_gemm(torch.float32, gathered=True)
    flags = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    _compile_exists(op, [_fake(s) for s in _specs(op)], flags)


# -- GPU: device function vs torch reference -------------------------------------------------
def _logits(t: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """Router logits x @ w^T; a constant column of x with large router weights skews them."""
    x = torch.randn(t, HIDDEN, generator=gen)
    w = torch.randn(E, HIDDEN, generator=gen)
    if routing != "random":
        x[:, 0] = 4.0
        w[:, 0] = 0.0
        w[5, 0] = -25.0  # expert 5 never chosen
        if routing == "one_expert":
            w[3, 0] = 25.0  # every token's top-1 is expert 3
    return x @ w.T


def _env(t: int) -> dict[str, int]:
    return {"T": t}


def _empty(spec: TensorSpec, env) -> torch.Tensor:
    shape = spec.concrete(env)
    if spec.dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=spec.dtype)
    return torch.full(shape, INT_POISON, dtype=spec.dtype)


def _reference(op: TileOp, inputs: dict[str, torch.Tensor], env) -> dict[str, torch.Tensor]:
    """The op's torch reference over its grid (fp32 tensors, CPU); skipped tiles stay poisoned."""
    t = {n: v.float() if v.dtype.is_floating_point else v.clone() for n, v in inputs.items()}
    for n, s in op.output_specs().items():
        out = _empty(s, env)
        t[n] = out.float() if out.dtype.is_floating_point else out
    for coord in itertools.product(*(range(evaluate(g, env)) for g in op.grid())):
        if op.exists(coord, env, t):
            op.reference(coord, env, t)
    return {n: t[n] for n in op.outputs}


def _device(op: TileOp, compiled, inputs: dict[str, torch.Tensor], env) -> dict[str, torch.Tensor]:
    outs = {n: _empty(s, env).cuda() for n, s in op.output_specs().items()}
    tensors = [inputs[n].cuda() for n in op.inputs] + [outs[n] for n in op.outputs]
    compiled(tensors, concrete_grid(op, env))
    torch.cuda.synchronize()
    return {n: v.cpu() for n, v in outs.items()}


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    nan = torch.isnan(ref) if ref.dtype.is_floating_point else ref == INT_POISON
    got_nan = torch.isnan(out) if out.dtype.is_floating_point else out == INT_POISON
    assert torch.equal(got_nan, nan), f"{name}: written/unwritten elements differ"
    if not ref.dtype.is_floating_point:
        assert torch.equal(out, ref), f"{name}: {out} != {ref}"
        return
    o, r = out[~nan].float(), ref[~nan]
    err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


def _compile_live(op: TileOp, inputs: dict[str, torch.Tensor], env):
    """Compile once per op: dynamic layouts let one kernel serve every token count."""
    outs = [_empty(s, env).cuda() for s in op.output_specs().values()]
    return compile_tile(op, [inputs[n].cuda() for n in op.inputs] + outs)


def _runs(op: TileOp, seed: int, inputs_of):
    """(case, device outputs, reference outputs) of ``op`` at every token count and routing,
    one compile: ``inputs_of(t, routing tensors, generator, env)`` makes a case's inputs."""
    gen = torch.Generator().manual_seed(seed)
    compiled = None
    for t, routing in itertools.product(TOKENS, ROUTINGS):
        env = _env(t)
        inputs = inputs_of(t, _routing(t, routing, gen), gen, env)
        compiled = compiled or _compile_live(op, inputs, env)
        yield f"T={t} {routing}", _device(op, compiled, inputs, env), _reference(op, inputs, env)


def _routing(t: int, routing: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """weights, ids, tile_info, row_token, slot_row from the torch references."""
    env = _env(t)
    logits = _logits(t, routing, gen)
    r = _reference(_topk(torch.float32), {"logits": logits}, env)
    r.update(_reference(_route(), {"ids": r["ids"]}, env))
    if routing == "one_expert":
        assert bool((r["ids"][:, 0] == 3).all()) and not bool((r["ids"] == 5).any())
    return r


def _gate_logits(t: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """Logits for the top-k test, skewed by +-30 rather than the MoE tests' +-100.

    With a gap of 100 the losing probabilities underflow to fp32 denormals, whose rounding
    makes ties torch breaks by id while the device (selecting on logits) does not: that order
    is backend-defined, so only routings whose probabilities are normal floats are compared.
    """
    logits = 2.0 * torch.randn(t, E, generator=gen)
    if routing != "random":
        logits[:, 5] -= 30.0
        if routing == "one_expert":
            logits[:, 3] += 30.0
    if routing == "ties":  # integer logits: many exact ties, which go to the lower id
        logits = logits.round().clamp(-2, 2)
    return logits


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp32", "bf16", "partials", "partials-bf16"])
def test_topk_softmax_matches_reference(case):
    """Logits in fp32 or bf16, or the router's split-K partials summed (and rounded to bf16)."""
    gen = torch.Generator().manual_seed(11)
    split = case.startswith("partials")
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    op = _topk_split(dtype if dtype != torch.float32 else None) if split else _topk(dtype)
    compiled = None
    for t, routing in itertools.product(TOKENS, ROUTINGS + ("ties",)):
        env = _env(t)
        logits = _gate_logits(t, routing, gen)
        if split:  # partials summing to the logits
            cuts = torch.rand(SPLITS, t, E, generator=gen)
            logits = logits * cuts / cuts.sum(0)
        inputs = {"logits": logits if split else logits.to(dtype)}
        compiled = compiled or _compile_live(op, inputs, env)
        got, ref = _device(op, compiled, inputs, env), _reference(op, inputs, env)
        _check(f"weights T={t} {routing}", got["weights"], ref["weights"], 1e-5)
        _check(f"ids T={t} {routing}", got["ids"], ref["ids"], 0)
        if routing == "one_expert":
            assert bool((got["ids"][:, 0] == 3).all()) and not bool((got["ids"] == 5).any())


@pytest.mark.gpu
def test_moe_route_matches_reference():
    gen = torch.Generator().manual_seed(12)
    op = _route()
    compiled = None
    for t, routing in itertools.product(TOKENS, ROUTINGS):
        env = _env(t)
        inputs = {"ids": _routing(t, routing, gen)["ids"]}
        compiled = compiled or _compile_live(op, inputs, env)
        got, ref = _device(op, compiled, inputs, env), _reference(op, inputs, env)
        for n in op.outputs:
            _check(f"{n} T={t} {routing}", got[n], ref[n], 0)


@pytest.mark.gpu
def test_moe_route_at_its_limits():
    """E = 128 experts (one per thread), top-8, up to 4096 tokens; distinct random ids."""
    gen = torch.Generator().manual_seed(15)
    num_e, k = 128, 8
    ids_spec = TensorSpec((_sym_t(), k), torch.int32)
    # one crowded expert below may repeat an id within a token: 32-bit counters
    op = ops.moe_route(ids_spec, num_experts=num_e, block_m=64, distinct_ids=False)
    compiled = None
    for t in (4096, 1000, 3):
        env = _env(t)
        ids = torch.rand(t, num_e, generator=gen).argsort(dim=-1)[:, :k].to(torch.int32)
        ids[: t // 2, 0] = 7  # one crowded expert
        inputs = {"ids": ids}
        compiled = compiled or _compile_live(op, inputs, env)
        got, ref = _device(op, compiled, inputs, env), _reference(op, inputs, env)
        for n in op.outputs:
            _check(f"{n} T={t}", got[n], ref[n], 0)


@pytest.mark.gpu
@FLOATS
@pytest.mark.parametrize("gathered", [True, False], ids=["gather", "padded"])
def test_moe_grouped_gemm_matches_reference(dtype, gathered):
    gen = torch.Generator().manual_seed(13)
    op = _grouped_gemm(dtype, gathered)
    compiled = exists = None
    for t, routing in itertools.product(TOKENS, ROUTINGS):
        env = _env(t)
        r = _routing(t, routing, gen)
        xs, ws = op.x.concrete(env), op.w.concrete(env)
        inputs = {
            "x": torch.randn(xs, generator=gen).to(dtype),
            "w": (torch.randn(ws, generator=gen) / ws[2] ** 0.5).to(dtype),
            "tile_info": r["tile_info"],
            "row_token": r["row_token"],
        }
        compiled = compiled or _compile_live(op, inputs, env)
        got, ref = _device(op, compiled, inputs, env), _reference(op, inputs, env)
        _check(f"out T={t} {routing}", got["out"], ref["out"], TOL[dtype])

        # device_exists agrees with the Python exists for every row tile
        tensors = [inputs[n].cuda() for n in op.inputs] + [got["out"].cuda()]
        flags = torch.full((r["tile_info"].shape[0],), INT_POISON, dtype=torch.int32).cuda()
        args = [as_cute_tensor(x) for x in tensors]
        exists = exists or _compile_exists(op, args, as_cute_tensor(flags))
        exists(tuple(args), as_cute_tensor(flags), _stream())
        torch.cuda.synchronize()
        want = [int(op.exists((i, 0), env, inputs)) for i in range(flags.numel())]
        assert flags.cpu().tolist() == want


def _stream():
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, hidden", [(torch.bfloat16, 40), (torch.bfloat16, 36), (torch.float32, 3)]
)
def test_moe_permute_matches_reference(dtype, hidden):
    """Every word width of the permute (16 and 8 bytes, elements): the valid rows of each
    existing tile bit for bit, nothing else written."""
    op = _permute(dtype, hidden)

    def inputs_of(t, r, gen, env):
        x = torch.randn(t, hidden, generator=gen).to(dtype)
        return {"x": x, "tile_info": r["tile_info"], "row_token": r["row_token"]}

    for case, got, ref in _runs(op, 15, inputs_of):
        valid = ~torch.isnan(ref["xp"])  # the reference poisons padding rows: unspecified
        assert torch.equal(got["xp"][valid], ref["xp"].to(dtype)[valid]), case
        assert torch.isnan(got["xp"][~valid]).all(), f"{case}: padding written"


@pytest.mark.gpu
@FLOATS
@pytest.mark.parametrize("block_n", [BN, 20], ids=["16B_words", "8B_words"])
def test_moe_combine_matches_reference(dtype, block_n):
    op = _combine(dtype, block_n)

    def inputs_of(t, r, gen, env):
        rows = torch.randn(op.rows.concrete(env), generator=gen).to(dtype)
        return {"rows": rows, "weights": r["weights"], "slot_row": r["slot_row"]}

    for case, got, ref in _runs(op, 14, inputs_of):
        _check(f"y {case}", got["y"], ref["y"], TOL[dtype])
