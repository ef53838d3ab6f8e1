"""GEMM and MLP inside the megakernel (Hopper TMA + wgmma tiles) vs cuBLAS, eager torch and CUDA
graphs, in one process.

Cases (bf16, Qwen3-8B MLP dims H=4096, I=12288 unless --small):
  gemm_gate_up  C = X @ W_gu^T  (T, 2I) from (T, H)     one gemm node
  gemm_down     C = A @ W_d^T   (T, H) from (T, I)      one gemm node
  mlp           down(silu(X W_g^T) * (X W_u^T))         gate/up gemm with the fused silu_mul
                epilogue, then the down gemm waiting tile by tile

Implementations:
  megakernel    the cutemk graph, replayed from a CUDA graph (no host overhead)
  torch         torch.matmul / F.silu (cuBLAS), replayed from a CUDA graph
  torch_eager   (mlp only) the same torch code launched eagerly

Each row also gives the roofline floor (FLOPs / 790 TFLOP/s vs bytes / 4.3 TB/s) and the
achieved fraction of it. Run: python benchmarks/gemm_mlp.py [--tokens 256 8192] [--small]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cutemk as mk
from cutemk import ops
from cutemk.bench import Results, floor_us, graphed, time_us
from cutemk.layers import mlp_graph


def time_rows(res, case, impls, flops, nbytes, blocks, err):
    """Time each ``(impl, fn)`` and add its row (the megakernel's carries blocks and error)."""
    fl = floor_us(flops, nbytes)
    for impl, fn in impls:
        us = time_us(fn, warmup=5, rep=50)
        mk_row = impl == "megakernel"
        res.add(
            case,
            impl,
            us,
            blocks="x".join(map(str, blocks)) if mk_row else "",
            tflops=round(flops / us / 1e6, 1),
            floor_us=round(fl, 2),
            of_floor=round(fl / us, 3),
            rel_err=round(err, 5) if mk_row else "",
        )


def gemm_case(res, name, t, n, k, blocks, dtype):
    g = mk.Graph(name)
    a = g.input("a", (mk.sym("T", max=t), k), dtype)
    w = g.weight("w", (n, k), dtype)
    g.output(g.call(ops.gemm, a, w, block_m=blocks[0], block_n=blocks[1]), "c")
    c = g.compile("cute", scheduler="static")
    x = torch.randn(t, k, device="cuda", dtype=dtype)
    wt = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    ref = x.float() @ wt.float().T
    err = ((c(x, wt).float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{name}: rel err {err:.2e}"
    flops, nbytes = 2.0 * t * n * k, 2.0 * (t * k + n * k + t * n)
    impls = (("megakernel", graphed(lambda: c(x, wt))), ("torch", graphed(lambda: x @ wt.T)))
    time_rows(res, f"{name} T={t} N={n} K={k}", impls, flops, nbytes, blocks, err)


def mlp_case(res, t, h, i, blocks, dtype):
    g = mlp_graph(mk.sym("T", max=t), h, i, dtype, blocks[0], blocks[1], fuse_silu=True)
    c = g.compile("cute", scheduler="static")
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    wgu = torch.randn(2 * i, h, device="cuda", dtype=dtype) / h**0.5
    wd = torch.randn(h, i, device="cuda", dtype=dtype) / i**0.5

    def torch_mlp():
        gu = x @ wgu.T
        return (F.silu(gu[:, :i]) * gu[:, i:]) @ wd.T

    ref = torch_mlp().float()
    err = ((c(x, wgu, wd).float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"mlp: rel err {err:.2e}"
    flops = 2.0 * t * h * 2 * i + 2.0 * t * i * h
    nbytes = 2.0 * (t * h * 2 + 3 * h * i)
    impls = (
        ("megakernel", graphed(lambda: c(x, wgu, wd))),
        ("torch", graphed(torch_mlp)),
        ("torch_eager", torch_mlp),
    )
    time_rows(res, f"mlp T={t} H={h} I={i}", impls, flops, nbytes, blocks, err)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    p.add_argument("--small", action="store_true", help="Qwen3-1.7B dims (H=2048, I=6144)")
    args = p.parse_args()
    h, i = (2048, 6144) if args.small else (4096, 12288)
    dtype = torch.bfloat16
    res = Results("gemm_mlp", meta={"dtype": "bf16", "hidden": h, "intermediate": i})
    for t in args.tokens:
        # small T: 64-row tiles so the grid still covers the 132 SMs
        blocks = (64, 128) if t <= 512 else (128, 128)
        fused = (64, 128) if t <= 512 else (128, 64)
        gemm_case(res, "gemm_gate_up", t, 2 * i, h, blocks, dtype)
        gemm_case(res, "gemm_down", t, h, i, blocks, dtype)
        mlp_case(res, t, h, i, fused, dtype)
    res.add_ratios("torch")
    res.finish()


if __name__ == "__main__":
    main()
