"""How much SASS each op of a layer's megakernel brings, compiled for sm_90a (no GPU needed).

A phase that runs on one or a few SMs of a launch that starts from a flushed L2 fetches its
instructions from HBM, so its code size is part of its time (``benchmarks/small_tasks.py``
measures that on a GPU). This tool compiles the whole megakernel of a layer's graph, then each
of its nodes alone (the same op instance, its arguments as graph inputs) and prints the
kernel's ``.text`` bytes: the one-op kernel's size minus that of a one-``add`` kernel (the
worker, its scheduler and a trivial body) is what the op adds.

Needs ``ptxas`` on the PATH. Run:
  python benchmarks/code_size.py [--layer moe-decoder|dense-decoder|moe] [--regime gemv]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

import cutemk as mk  # noqa: E402
from cutemk import ops  # noqa: E402
from cutemk.kernels import compile_offline  # noqa: E402


def cubin(graph: mk.Graph, scheduler: str, d: str) -> str:
    """``graph``'s megakernel for sm_90a as a cubin in directory ``d`` (PTX from the DSL,
    ``ptxas``); its path."""
    compile_offline(graph, scheduler, options=f"--keep-ptx --dump-dir={d}")
    (ptx,) = glob.glob(os.path.join(d, "*.ptx"))
    path = os.path.join(d, "k.cubin")
    subprocess.run(["ptxas", "-arch=sm_90a", ptx, "-o", path], check=True)
    return path


def text_bytes(graph: mk.Graph, scheduler: str = "static") -> int:
    """The ``.text`` bytes of ``graph``'s megakernel for sm_90a (PTX from the DSL, ``ptxas``)."""
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            ["readelf", "-S", "-W", cubin(graph, scheduler, d)], capture_output=True, text=True
        )
    total = 0
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1].startswith(".text."):
            total += int(parts[5], 16)
    return total


def one_op_graph(node) -> mk.Graph:
    """A graph of ``node``'s op alone, its arguments as inputs, every result an output."""
    g = mk.Graph(f"only_{node.name}")
    args = [g.input(f"in{i}", v.spec.shape, v.spec.dtype) for i, v in enumerate(node.args.values())]
    res = g.call(node.op, *args, name=node.name)
    res = res if isinstance(res, tuple) else (res,)
    for i, r in enumerate(res):
        if not r.is_own_counter:
            g.output(r, f"out{i}")
    return g


def baseline_graph() -> mk.Graph:
    g = mk.Graph("only_add")
    a = g.input("a", (1, 8), torch.bfloat16)
    b = g.input("b", (1, 8), torch.bfloat16)
    g.output(g.call(ops.add, a, b, block_m=1), "y")
    return g


def layer_graph(layer: str, regime: str) -> mk.Graph:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from decoder_cases import QWEN3_8B_DECODE, QWEN3_30B_DECODE, bare_decoder

    from cutemk.layers import MoeConfig
    from cutemk.regimes import moe_regime_graph

    moe = MoeConfig(2048, 768, 128, 8, router_dtype=None)
    if layer == "moe":
        limit = {"slots": 2, "gemv": 16}.get(regime, 1024)
        return moe_regime_graph(2048, 768, 128, 8, True, regime, torch.bfloat16, limit)
    if layer == "moe-decoder":
        return bare_decoder(QWEN3_30B_DECODE, moe).regime_graph(regime, torch.bfloat16)
    return bare_decoder(QWEN3_8B_DECODE).regime_graph(regime, torch.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--layer", default="moe-decoder", choices=("moe-decoder", "dense-decoder", "moe")
    )
    p.add_argument("--regime", default="gemv", help="slots, gemv, decode (or prefill: moe)")
    args = p.parse_args(argv)
    regimes = {"moe": ("slots", "gemv", "decode", "prefill")}.get(
        args.layer,
        ("gemv_tail", "gemv", "batch")
        if args.layer == "dense-decoder"
        else ("slots", "gemv", "batch"),
    )
    if args.regime not in regimes:
        p.error(f"--regime for {args.layer}: one of {', '.join(regimes)}")
    g = layer_graph(args.layer, args.regime)
    base = text_bytes(baseline_graph())
    print(f"{args.layer} '{args.regime}': whole kernel {text_bytes(g) / 1024:.1f} KB of SASS")
    print(f"worker + a one-row add: {base / 1024:.1f} KB")
    seen = {}
    for node in g.nodes:
        key = repr(node.op)
        if key not in seen:
            try:
                seen[key] = (text_bytes(one_op_graph(node)) - base) / 1024
            except Exception as e:  # noqa: BLE001  (a node that will not stand alone)
                seen[key] = f"{type(e).__name__}: {str(e)[:80]}"
        v = seen[key]
        print(
            f"  {node.name:<22} {node.op.name:<22} "
            + (f"+{v:.1f} KB" if isinstance(v, float) else v)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
