"""GEMM + reduce-scatter and all-gather + GEMM in one megakernel vs cuBLAS + NCCL.

Run with one process per GPU (TP = number of processes):

    torchrun --nproc_per_node=8 benchmarks/comm_gemm.py [--tokens 8192] [--quick]

Cases, per MLP shape (hidden H, intermediate I; tokens T over TP ranks):
  gemm_rs   row-parallel down projection: a (T, I/TP) @ w (H, I/TP)^T, reduce-scatter
            -> (T/TP, H) per rank. Megakernel: dynamic scheduler.
  ag_gemm   column-parallel gate/up projection: all-gather x (T/TP, H) -> (T, H),
            @ w (2I/TP, H)^T -> (T, 2I/TP) per rank. Megakernel: static scheduler.

Implementations, in this process on the same data:
  megakernel     cutemk (cutemk.tp graphs), one launch per call
  cublas_nccl    torch.matmul + dist.reduce_scatter_tensor / dist.all_gather_into_tensor

The time of a case is the slowest rank's median (CUDA events, after a barrier). Each case first
checks the megakernel's output against the baseline's (bf16 relative error). Results go to
benchmarks/results/comm_gemm.json (on rank 0) with speedups vs cublas_nccl and the fraction of
the bf16 FLOP floor (GEMM FLOPs / 790 TFLOP/s; the NVLink bytes moved per rank are listed too).

The MLP shapes are Qwen3-8B (4096, 12288) and Qwen3-32B (5120, 25600).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import cutemk as mk
from cutemk.bench import Results, floor_us, time_us
from cutemk.tp import ag_gemm_graph, gemm_rs_graph

SHAPES = {"qwen3-8b": (4096, 12288), "qwen3-32b": (5120, 25600)}


def slowest(us: float) -> float:
    t = torch.tensor([us], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn, rep: int) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    return slowest(time_us(fn, warmup=5, rep=rep))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    e = torch.tensor([((a.float() - b.float()).norm() / b.float().norm()).item()], device="cuda")
    dist.all_reduce(e, op=dist.ReduceOp.MAX)
    return float(e.item())


def gemm_rs(res, shape, h, i, t, tp, rep):
    k = i // tp
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(h, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    out = torch.empty(t // tp, h, device="cuda", dtype=torch.bfloat16)

    def base():
        dist.reduce_scatter_tensor(out, a @ w.T)
        return out

    g = gemm_rs_graph(mk.sym("T", max=t), k, h, tp, torch.bfloat16, 128, 128)
    c = g.compile("cute", scheduler="dynamic")
    err = rel_err(c(a, w), base())
    flops = 2.0 * t * h * k
    case = f"gemm_rs {shape} T={t} TP={tp}"
    _rows(res, case, flops, (tp - 1) / tp * t * h * 2, err, (c, (a, w)), base, rep)


def ag_gemm(res, shape, h, i, t, tp, rep):
    n = 2 * i // tp
    x = torch.randn(t // tp, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    full = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)

    def base():
        dist.all_gather_into_tensor(full, x)
        return full @ w.T

    g = ag_gemm_graph(mk.sym("S", max=t // tp), h, n, tp, torch.bfloat16, 128, 128, 64)
    c = g.compile("cute", scheduler="static")
    err = rel_err(c(x, w), base())
    flops = 2.0 * t * h * n
    case = f"ag_gemm {shape} T={t} TP={tp}"
    _rows(res, case, flops, (tp - 1) / tp * t * h * 2, err, (c, (x, w)), base, rep)


def _rows(res, case, flops, link_bytes, err, mk_call, base, rep):
    c, args = mk_call
    fl = floor_us(flops)
    for impl, fn in (("megakernel", lambda: c(*args)), ("cublas_nccl", base)):
        us = timed(fn, rep)
        res.add(
            case,
            impl,
            us,
            tflops=round(flops / us / 1e6, 1),
            flop_floor_us=round(fl, 1),
            of_floor=round(fl / us, 3),
            nvlink_mb_per_rank=round(link_bytes / 1e6, 1),
            rel_err_vs_baseline=round(err, 5) if impl == "megakernel" else "",
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="fewer timed repetitions")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(rank)
    rep = 10 if args.quick else 30
    res = Results("comm_gemm", meta={"tp": tp, "tokens": args.tokens, "dtype": "bf16"})
    for shape in args.shapes:
        h, i = SHAPES[shape]
        gemm_rs(res, shape, h, i, args.tokens, tp, rep)
        ag_gemm(res, shape, h, i, args.tokens, tp, rep)
    res.add_ratios("cublas_nccl")
    if rank == 0:
        res.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
