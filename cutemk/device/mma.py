"""Warp-level tensor-core instructions (``mma.sync``) on registers a tile body holds itself.

The tiled-MMA machinery (``cute.make_tiled_mma``) partitions whole tiles; a body whose operands
are a few fragments it loads by hand (decode attention: 16 query-head rows against 8 tokens)
calls these instead. Operands follow the PTX ISA fragment layouts of ``m16n8k16`` / ``m16n8k8``
with 16-bit A and B and fp32 accumulators, for lane ``l``, ``r = l // 4``, ``c = l % 4``:

- A (16 x K, row-major), 32-bit registers of two consecutive-k elements: ``a0`` = (r, 2c..2c+1),
  ``a1`` = (r + 8, 2c..), and for k16 ``a2`` = (r, 8 + 2c..), ``a3`` = (r + 8, 8 + 2c..).
- B (K x 8, "col"): ``b0`` = (2c..2c+1, r), for k16 ``b1`` = (8 + 2c.., r).
- C / D (16 x 8): ``d0, d1`` = (r, 2c), (r, 2c + 1); ``d2, d3`` = (r + 8, 2c), (r + 8, 2c + 1).

So D of one product is, packed in pairs, the A of the next (``pack2``): flash attention's P.
"""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

_KIND = {"bf16": "bf16", "f16": "f16"}


def _asm(ret, operands, text: str, constraints: str, loc, ip, side_effects: bool = False):
    return llvm.inline_asm(
        ret,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _mma(shape: str, kind: str, a, b, c, loc, ip):
    na, nb = len(a), len(b)
    regs = [Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, *b)]
    accs = [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    ka = ",".join(f"${4 + i}" for i in range(na))
    kb = ",".join(f"${4 + na + i}" for i in range(nb))
    kc = ",".join(f"${4 + na + nb + i}" for i in range(4))
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        regs + accs,
        f"mma.sync.aligned.{shape}.row.col.f32.{_KIND[kind]}.{_KIND[kind]}.f32 "
        f"{{$0,$1,$2,$3}}, {{{ka}}}, {{{kb}}}, {{{kc}}};",
        "=f,=f,=f,=f," + ",".join(["r"] * (na + nb)) + ",0,1,2,3",
        loc,
        ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def mma_16816(kind: str, a, b, c, *, loc=None, ip=None):
    """``D = A (16 x 16) B (16 x 8) + C``: ``a`` 4 packed registers, ``b`` 2, ``c`` 4 fp32;
    returns D's 4 fp32. ``kind``: ``"bf16"`` or ``"f16"``."""
    return _mma("m16n8k16", kind, a, b, c, loc, ip)


@dsl_user_op
def mma_1688(kind: str, a, b, c, *, loc=None, ip=None):
    """``D = A (16 x 8) B (8 x 8) + C``: ``a`` 2 packed registers, ``b`` 1, ``c`` 4 fp32."""
    return _mma("m16n8k8", kind, a, b, c, loc, ip)


@dsl_user_op
def pack2(kind: str, lo, hi, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to 16 bits, ``lo`` in the low half (an A / B register)."""
    r = _asm(
        T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{_KIND[kind]}x2.f32 $0, $1, $2;",  # the first source goes to the upper half
        "=r,f,f",
        loc,
        ip,
    )
    return Int32(r)


@dsl_user_op
def ldmatrix_x4(ptr, trans: bool = False, *, loc=None, ip=None):
    """Four 8 x 8 matrices of 16-bit elements from shared memory (``ldmatrix .x4``): lanes
    ``8i .. 8i + 7`` give the addresses of matrix i's 8 rows (16 bytes each, ``ptr`` a shared
    pointer); returns one register a matrix. Plain, lane l gets row ``l // 4``, elements
    ``2 (l % 4) ..``: a B fragment whose columns are the matrix's rows. ``trans``, lane l gets
    rows ``2 (l % 4) ..`` of column ``l // 4``: a B fragment of the matrix as it is stored."""
    addr = llvm.ptrtoint(T.i32(), ptr.llvm_ptr, loc=loc, ip=ip)
    t = ".trans" if trans else ""
    # a side effect: the load must stay after the ring wait that makes the data visible
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [addr],
        f"ldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
        "=r,=r,=r,=r,r",
        loc,
        ip,
        side_effects=True,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))
