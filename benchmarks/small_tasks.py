"""What a small task costs inside a megakernel, from a cold and from a warm L2.

A decode step is a chain of small phases (a norm of one row, a residual add, a top-k) between
the weight-streaming ones, and in the traces each of them takes 2.5 to 5 us of one SM for a
few KB of data. This probe runs such a chain alone: ``--links`` rounds of ``rmsnorm`` (one row
of ``--hidden`` columns, its own weight) then ``add`` (the norm's output plus the round's
input), one task each, under the static scheduler, profiled. It traces one launch after the
256 MB read that precedes every timed call (``cutemk.bench.flush_l2``: the kernel's code and
the weights come from HBM) and one right after another launch (both in L2), and times CUDA
graph replays both ways.

An ``add`` task reads only rows written earlier in the same launch (in L2 either way), so the
difference between its cold and warm times is instruction fetch: the megakernel's code is
evicted from L2 like any data.

``--stream-mb N`` adds, in the same launch and independent of the chain, a one-row GEMV over
an N MB weight (64-column tiles of K=4096 on the other SMs): the chain's tasks then run while
HBM is busy, as a decode step's small phases do while the next phase's weights stream in.
Their task times against the run without it tell what memory latency under load costs them.

Run: python benchmarks/small_tasks.py [--links 6] [--hidden 2048] [--stream-mb 0] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import cutemk as mk
from cutemk import ops
from cutemk.bench import Results, flush_l2, graphed, time_us
from cutemk.layers import linear

STREAM_K = 4096


def stream_rows(stream_mb: int) -> int:
    """The GEMV weight's rows for ``stream_mb`` MB of bf16 (K = ``STREAM_K``), whole tiles."""
    return max(64, stream_mb * 2**20 // (2 * STREAM_K) // 64 * 64)


def chain_graph(links: int, hidden: int, stream_mb: int = 0) -> mk.Graph:
    g = mk.Graph("small_tasks")
    t = mk.sym("T", max=16)
    h = g.input("x", (t, hidden), torch.bfloat16)
    for i in range(links):
        w = g.weight(f"w{i}", (hidden,), torch.bfloat16)
        n = g.call(ops.rmsnorm, h, w, eps=1e-6, block_m=1, name=f"norm{i}")
        h = g.call(ops.add, n, h, block_m=1, name=f"add{i}")
    g.output(h, "y")  # the chain's result first: the call returns it first
    if stream_mb:
        xs = g.input("xs", (t, STREAM_K), torch.bfloat16)
        ws = g.weight("ws", (stream_rows(stream_mb), STREAM_K), torch.bfloat16)
        g.output(linear(g, xs, ws, block_m=64, block_n=64, name="stream"), "ys")
    return g


def node_times(records: list[dict]) -> dict[str, float]:
    """Median task microseconds per node kind (norm / add), and the chain's span."""
    by: dict[str, list[float]] = {"norm": [], "add": []}
    records = [r for r in records if r["node"].startswith(("norm", "add"))]
    for r in records:
        kind = "norm" if r["node"].startswith("norm") else "add"
        by[kind].append((r["end_ns"] - r["start_ns"]) / 1e3)
    out = {f"{k}_task_us": round(statistics.median(v), 2) for k, v in by.items() if v}
    first = [r for r in records if r["node"] in ("norm0", "add0")]
    rest = [r for r in records if r["node"] not in ("norm0", "add0")]
    for name, rs in (("first_link", first), ("later_links", rest)):
        for k in ("norm", "add"):
            v = [(r["end_ns"] - r["start_ns"]) / 1e3 for r in rs if r["node"].startswith(k)]
            if v:
                out[f"{name}_{k}_us"] = round(statistics.median(v), 2)
    out["span_us"] = round(
        (max(r["end_ns"] for r in records) - min(r["start_ns"] for r in records)) / 1e3, 2
    )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", type=int, default=6)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--stream-mb", type=int, default=0, help="a concurrent GEMV's weight, MB")
    p.add_argument("--quick", action="store_true", help="3 warm-up, 20 timed runs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.links < 1 or args.hidden < 8 or args.hidden % 8 or args.stream_mb < 0:
        p.error("--links >= 1, --hidden a positive multiple of 8, --stream-mb >= 0")
    warmup, rep = (3, 20) if args.quick else (10, 100)
    meta = {"links": args.links, "hidden": args.hidden, "stream_mb": args.stream_mb, "rep": rep}
    res = Results("small_tasks", meta=meta)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, args.hidden, device="cuda", generator=gen).bfloat16()
    ws = {
        f"w{i}": (1 + 0.1 * torch.randn(args.hidden, device="cuda", generator=gen)).bfloat16()
        for i in range(args.links)
    }
    if args.stream_mb:
        ws["xs"] = torch.randn(1, STREAM_K, device="cuda", generator=gen).bfloat16()
        ws["ws"] = (
            torch.randn(stream_rows(args.stream_mb), STREAM_K, device="cuda", generator=gen)
            .mul(0.02)
            .bfloat16()
        )
    g = chain_graph(args.links, args.hidden, args.stream_mb)
    plain = g.compile("cute", scheduler="static")
    traced = g.compile("cute", scheduler="static", profile=True)
    want = x.float()
    for i in range(args.links):
        w = ws[f"w{i}"].float()
        n = (want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * w).bfloat16()
        want = (n.float() + want).bfloat16().float()
    got = plain(x, **ws)
    got = (got[0] if isinstance(got, tuple) else got).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err < 2e-2:
        raise SystemExit(f"small_tasks: result off the fp32 reference (rel err {err:.3g})")
    for l2 in ("cold", "warm"):
        for _ in range(3):
            traced(x, **ws)
        if l2 == "cold":
            flush_l2()
        traced(x, **ws)
        torch.cuda.synchronize()
        times = node_times(traced.profile_records())
        replay = graphed(lambda: plain(x, **ws))
        us = time_us(replay, warmup=warmup, rep=rep, cold_l2=l2 == "cold")
        res.add(f"{l2} L2", "mk_chain", us, rel_err=round(err, 4), **times)
    res.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
