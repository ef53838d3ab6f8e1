"""Tile and ring-depth sweep of one megakernel GEMM (tuning aid), against cuBLAS in the same
process. Each (tiles, stages) pair is its own compiled kernel (``CUTEMK_RING_STAGES`` caps the
ring depth the worker would otherwise size from shared memory).

``--fused``: the gate/up GEMM with the SiLU*mul epilogue (n output columns from a (2n, k) B;
cuBLAS does the plain (2n)-column GEMM).

Run: python benchmarks/gemm_sweep.py --t 1 --n 24576 --k 4096 --tiles 64x32 64x64 --stages 2 4 16
"""

from __future__ import annotations

import argparse
import os

import torch

from cutemk.bench import Results, floor_us, graphed, time_us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t", type=int, default=1)
    p.add_argument("--n", type=int, default=24576)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--tiles", nargs="+", default=["64x32"])
    p.add_argument("--stages", nargs="+", type=int, default=[16])
    p.add_argument("--scheduler", default="static")
    p.add_argument(
        "--fused", action="store_true", help="gate/up with the SiLU*mul epilogue: B is (2n, k)"
    )
    args = p.parse_args(argv)
    import cutemk as mk
    from cutemk import ops

    t, n, k = args.t, args.n, args.k
    a = torch.randn(t, k, device="cuda").bfloat16()
    nb = 2 if args.fused else 1
    w = (torch.randn(nb * n, k, device="cuda") / k**0.5).bfloat16()
    ref = a.float() @ w.float().T
    if args.fused:
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    fl = floor_us(2.0 * t * nb * n * k, 2 * (t * k + nb * n * k + t * n))
    meta = {"t": t, "n": n, "k": k, "scheduler": args.scheduler, "fused": args.fused}
    res = Results("gemm_sweep", meta=meta)
    res.add(f"T={t}", "cublas", time_us(graphed(lambda: a @ w.T)), floor_us=round(fl, 2))
    epi = "silu_mul" if args.fused else None
    for tiles in args.tiles:
        bm, bn = (int(v) for v in tiles.split("x"))
        for st in args.stages:
            os.environ["CUTEMK_RING_STAGES"] = str(st)
            g = mk.Graph(f"sweep_{bm}x{bn}_{st}")
            x = g.input("a", (mk.sym("T", max=max(t, 128)), k), torch.bfloat16)
            wt = g.weight("w", (nb * n, k), torch.bfloat16)
            g.output(g.call(ops.gemm, x, wt, block_m=bm, block_n=bn, epilogue=epi), "c")
            c = g.compile("cute", scheduler=args.scheduler)
            err = ((c(a, w).float() - ref).norm() / ref.norm()).item()
            us = time_us(graphed(lambda: c(a, w)))
            stages = c.spec.worker.ring_stages
            res.add(
                f"T={t}", f"mk {tiles} s{stages}", us, floor_us=round(fl, 2), rel_err=round(err, 5)
            )
    res.add_ratios("cublas")
    print(res.table())
    res.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
