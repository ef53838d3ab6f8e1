"""Scheduler overhead of the megakernel: empty tasks, static vs dynamic, vs kernel boundaries.

Cases (synthetic DAG op, work = 0 ns per task):
  independent  n tasks, no dependencies
  chain_w1     one chain of n tasks (each waits on the previous: pure notify -> wait latency)
  chain_w132   132 independent chains
  fanin8       layers of 132 tasks, each waiting on 8 random tasks of the layer before

Implementations, all in this process on the same data:
  mk_static / mk_dynamic            megakernel call from Python (includes host overhead)
  mk_static_graph / mk_dynamic_graph   the same launch replayed from a CUDA graph
  launches         one kernel launch per dependency layer (a kernel boundary per layer)
  launches_graph   those launches captured in one CUDA graph

Per-task overhead = median time x SMs / tasks (the time one SM spends per task).
Run: python benchmarks/scheduler_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import random

import torch

import cutemk as mk
from cutemk import ops
from cutemk.bench import Results, time_us
from cutemk.device.harness import compile_tile

N = mk.sym("N", max=1 << 16)
M = mk.sym("M", max=1 << 20)


def cases(sms: int, depth: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    """name -> (deps, layer sizes)."""
    rng = random.Random(0)
    n_ind = sms * depth
    out = {"independent": ([[] for _ in range(n_ind)], [n_ind])}
    out["chain_w1"] = ([[t - 1] if t else [] for t in range(depth * 8)], [1] * (depth * 8))
    deps = []
    for layer in range(depth):
        for c in range(sms):
            deps.append([(layer - 1) * sms + c] if layer else [])
    out[f"chain_w{sms}"] = (deps, [sms] * depth)
    deps = []
    for layer in range(depth):
        for _ in range(sms):
            deps.append(
                sorted(rng.sample(range((layer - 1) * sms, layer * sms), 8)) if layer else []
            )
    out["fanin8"] = (deps, [sms] * depth)
    return out


def graph_time(fn) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fn()
    torch.cuda.synchronize()
    return time_us(g.replay, warmup=5, rep=50)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer layers (smoke run)")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    depth = 8 if args.quick else 32
    res = Results("scheduler_overhead", meta={"sms": sms, "depth": depth, "work_ns": 0})
    layer_kernel = None
    for name, (deps, layers) in cases(sms, depth).items():
        n = len(deps)
        inputs = ops.dag_inputs(deps, 0, device="cuda")
        g = ops.dag_graph(deps, N, M, name=name, empty=True)
        for sched in ("static", "dynamic"):
            c = g.compile("cute", scheduler=sched)
            c(*inputs)
            for impl, t in (
                (f"mk_{sched}", time_us(lambda: c(*inputs), rep=50, cold_l2=False)),
                (f"mk_{sched}_graph", graph_time(lambda: c(*inputs))),
            ):
                res.add(
                    name,
                    impl,
                    t,
                    tasks=n,
                    tasks_per_us=round(n / t, 2),
                    per_task_overhead_us=round(t * sms / n, 3),
                )
        # kernel boundaries: one launch per layer, each CTA one empty task
        layer_inputs = [ops.dag_inputs([[] for _ in range(w)], 0, device="cuda") for w in layers]
        layer_outs = [torch.empty(w, dtype=torch.int32, device="cuda") for w in layers]
        if layer_kernel is None:  # the same device function as the megakernel's tasks
            layer_kernel = compile_tile(g.nodes[0].op, (*layer_inputs[0], layer_outs[0]))

        def launches():
            for li, lo, w in zip(layer_inputs, layer_outs, layers):
                layer_kernel((*li, lo), (w,))

        for impl, t in (
            ("launches", time_us(launches, rep=20, cold_l2=False)),
            ("launches_graph", graph_time(launches)),
        ):
            res.add(
                name,
                impl,
                t,
                tasks=n,
                tasks_per_us=round(n / t, 2),
                per_task_overhead_us=round(t * sms / n, 3),
                kernels=len(layers),
            )
    res.add_ratios("launches_graph")
    res.finish()


if __name__ == "__main__":
    main()
