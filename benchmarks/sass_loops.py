"""The instruction mix of a megakernel's inner loops, compiled for sm_90a (no GPU needed).

Compiles a graph's megakernel to PTX (CuTe DSL), then to a cubin (``ptxas``), disassembles it
(``nvdisasm``: on the PATH, or the one Triton bundles) and lists every loop (a backward branch
and the code it jumps over) that issues tensor-core (``HGMMA``) or special-function (``MUFU``)
instructions: its SASS instruction count and most frequent opcodes. A loop's count covers every
path through its body (e.g. a step's masked and unmasked forms), so compare loops of kernels
that differ in one thing.

Graphs: ``prefill`` (``benchmarks/attention.py``'s causal prefill tile, ``--step 64`` or 128).

Run: python benchmarks/sass_loops.py [--graph prefill] [--step 64] [--scheduler static]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from code_size import cubin  # noqa: E402

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


def nvdisasm() -> str:
    """``nvdisasm`` from the PATH, else Triton's copy."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    except ImportError:
        path = ""
    if not os.path.isfile(path):
        raise SystemExit("sass_loops: needs nvdisasm (CUDA toolkit, or Triton's copy)")
    return path


def opcode(text: str) -> str:
    """The opcode of an instruction's text, without its predicate and modifiers."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, opcode counts) of every backward branch's range in ``sass``."""
    ins: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            ins.append((addr, m.group(2)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (addr, text) in enumerate(ins):
        m = _BRANCH.search(text)
        if m and labels.get(m.group(1), addr) < addr:
            start = labels[m.group(1)]
            body = ins[index[start] : i + 1]
            out.append((start, addr, collections.Counter(opcode(t) for _, t in body)))
    return out


def kernel_sass(graph, scheduler: str) -> str:
    """``graph``'s megakernel for sm_90a, disassembled."""
    with tempfile.TemporaryDirectory() as d:
        return subprocess.run(
            [nvdisasm(), "-c", cubin(graph, scheduler, d)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def build(name: str, step: int):
    if name == "prefill":
        from attention import _prefill_graph

        return _prefill_graph(8192, 8192, step)
    raise SystemExit(f"sass_loops: unknown graph {name!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", default="prefill", choices=("prefill",))
    p.add_argument("--step", type=int, default=64, choices=(64, 128), help="prefill keys a step")
    p.add_argument("--scheduler", default="static")
    p.add_argument("--top", type=int, default=14, help="opcodes listed a loop")
    args = p.parse_args(argv)
    sass = kernel_sass(build(args.graph, args.step), args.scheduler)
    hot = [lp for lp in loops(sass) if lp[2]["HGMMA"] or lp[2]["MUFU"]]
    print(f"{args.graph} (step {args.step}, {args.scheduler}): {len(hot)} loops with HGMMA/MUFU")
    # innermost first: the shortest loops are the steps themselves
    for start, end, ops in sorted(hot, key=lambda lp: sum(lp[2].values())):
        mix = ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top))
        print(f"{start:#07x}-{end:#07x} {sum(ops.values()):5d} instructions | {mix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
