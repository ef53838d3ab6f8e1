"""What one launch costs before any work: the megakernel with a single tiny task against one
trivial torch kernel, each replayed from a CUDA graph, from a cold L2 (``cutemk.bench.time_us``'s
default: a 256 MB read before each call) and from a warm one (back-to-back replays).

Cases:
  torch_add        ``y.add_(1)`` on 64 floats: one kernel launch
  mk_dag_<sched>   a one-task synthetic DAG (no shared-memory ring: the SIMT worker shape)
  mk_gemm_<sched>  one 64x64 bf16 GEMM tile (K=256) on the Hopper ring worker, the shape
                   (~227 KB of shared memory per CTA) every real layer runs with

The difference between a megakernel row and ``torch_add`` is the megakernel's fixed cost per
launch (its launch, prologue, first task fetch and the last CTA's close).

Run: python benchmarks/launch_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch

import cutemk as mk
from cutemk import ops
from cutemk.bench import Results, graphed, time_us
from cutemk.layers import linear


def _gemm_graph():
    t = mk.sym("T", max=64)
    g = mk.Graph("launch_gemm")
    x = g.input("x", (t, 256), torch.bfloat16)
    w = g.weight("w", (64, 256), torch.bfloat16)
    g.output(linear(g, x, w, block_m=64, block_n=64, split_k=1), "y")
    return g


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 warm-up, 20 timed runs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    warmup, rep = (3, 20) if args.quick else (10, 100)
    res = Results("launch_overhead", meta={"rep": rep})
    y = torch.zeros(64, device="cuda")
    calls = {"torch_add": lambda: y.add_(1)}
    deps = [[]]
    dag_in = ops.dag_inputs(deps, 0, device="cuda")
    x = torch.randn(1, 256, device="cuda").bfloat16()
    wt = torch.randn(64, 256, device="cuda").bfloat16()
    for sched in ("static", "dynamic"):
        c = ops.dag_graph(deps, mk.sym("N", max=64), mk.sym("M", max=64), empty=True).compile(
            "cute", scheduler=sched
        )
        calls[f"mk_dag_{sched}"] = lambda c=c: c(*dag_in)
        cg = _gemm_graph().compile("cute", scheduler=sched)
        calls[f"mk_gemm_{sched}"] = lambda cg=cg: cg(x, w=wt)
    for name, fn in calls.items():
        replay = graphed(fn)
        for l2 in ("cold", "warm"):
            us = time_us(replay, warmup=warmup, rep=rep, cold_l2=l2 == "cold")
            res.add(f"{l2} L2", name, us)
    res.add_ratios("torch_add")
    res.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
