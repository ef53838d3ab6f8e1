"""One GEMM in the megakernel vs cuBLAS (torch.matmul) vs quack, in one process.

C = A @ W^T with A (T, K) and W (N, K) in nn.Linear's layout, bf16, fp32 accumulation.
Cases: the 8192^3 square GEMM, and the two GEMMs of each MLP in benchmarks/mlp.py, gate_up
(N = 2I, K = H) and down (N = H, K = I), at T in {1, 16, 128, 256, 8192}.

Implementations, each replayed from a CUDA graph:
  megakernel  a one-node cutemk graph (static scheduler), tiles from ``gemm_tiles(T)``; one
              compiled kernel per (N, K, tiles) serves every T of the case list
  cublas      torch.matmul
  quack       quack.gemm_interface.gemm(A, B) with B = W^T, a (K, N) view of W (column skipped
              where quack is not installed). Its heuristic config by default; --quack-tuned runs
              its autotuner (minutes per shape).

Columns: median_us, tflops, of_best (time of the faster of cuBLAS and quack / this time),
of_floor (FLOPs / 790 TFLOP/s vs bytes / 4.3 TB/s) and rel_err against an fp32 matmul.

Run: python benchmarks/gemm.py [--cases qwen3-8b square] [--tokens 1 8192] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from cutemk.bench import Results, bar_chart, floor_us, graphed, time_us

MLPS = {  # the MLPs of benchmarks/mlp.py: (hidden, intermediate)
    "qwen3-8b": (4096, 12288),
    "llama-3.1-8b": (4096, 14336),
    "gemma-2-9b": (3584, 14336),
    "gemma-2-27b": (4608, 36864),
    "qwen3-32b": (5120, 25600),
}
TOKENS = (1, 16, 128, 256, 8192)
DECODE_MAX_TOKENS = 128


def gemm_tiles(tokens: int) -> tuple[int, int]:
    """(block_m, block_n) of the megakernel GEMM for T rows. At decode sizes the rows fit one
    64-row tile, so narrow 32-column tiles are what spreads the weight read over all SMs;
    above, 128x256 tiles halve the re-reads of A against 128x128 (where the Hopper tile's
    accumulator budget in ops/gemm_sm90.py admits them; otherwise the portable tile runs)."""
    return (64, 32) if tokens <= DECODE_MAX_TOKENS else (128, 256)


def case_list(tokens: tuple[int, ...], filters: list[str]) -> list[tuple[str, int, int, int]]:
    """(name, T, N, K) of every case whose name contains any filter (all without filters)."""
    cases = [("square 8192^3", 8192, 8192, 8192)]
    for model, (h, i) in MLPS.items():
        for t in tokens:
            cases.append((f"{model} gate_up T={t}", t, 2 * i, h))
            cases.append((f"{model} down T={t}", t, h, i))
    return [c for c in cases if not filters or any(f in c[0] for f in filters)]


def load_quack():
    try:
        from quack.gemm_interface import gemm
    except Exception as e:  # not installed, or built for another CuTe DSL
        print(f"quack unavailable ({type(e).__name__}: {e}); skipping its column")
        return None
    return gemm


class MegakernelGemms:
    """Compiled one-GEMM graphs, one per (N, K, tiles), each serving T up to ``max_tokens``."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._graphs: dict[tuple, object] = {}

    def __call__(self, t: int, n: int, k: int):
        import cutemk as mk
        from cutemk import ops

        bm, bn = gemm_tiles(t)
        key = (n, k, bm, bn)
        if key not in self._graphs:
            limit = DECODE_MAX_TOKENS if t <= DECODE_MAX_TOKENS else self.max_tokens
            g = mk.Graph(f"gemm_n{n}_k{k}")
            a = g.input("a", (mk.sym("T", max=limit), k), torch.bfloat16)
            w = g.weight("w", (n, k), torch.bfloat16)
            g.output(g.call(ops.gemm, a, w, block_m=bm, block_n=bn), "c")
            self._graphs[key] = g.compile("cute", scheduler="static")
        return self._graphs[key], f"{bm}x{bn}"


def run_case(res, case, mk_gemms, quack_gemm, quack_tuned, warmup, rep) -> None:
    name, t, n, k = case
    a = torch.randn(t, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    compiled, tiles = mk_gemms(t, n, k)
    impls = {"megakernel": lambda: compiled(a, w), "cublas": lambda: a @ w.T}
    if quack_gemm is not None:
        impls["quack"] = lambda: quack_gemm(a, w.T, tuned=quack_tuned)
    ref = a.float() @ w.float().T
    errs, times = {}, {}
    for impl, fn in list(impls.items()):
        try:
            errs[impl] = ((fn().float() - ref).norm() / ref.norm()).item()
            times[impl] = time_us(graphed(fn), warmup=warmup, rep=rep)
        except Exception as e:  # one library refusing a shape must not end the run
            print(f"{name} {impl}: {type(e).__name__}: {e}")
    del ref
    flops, nbytes = 2.0 * t * n * k, 2.0 * (t * k + n * k + t * n)
    fl = floor_us(flops, nbytes)
    best = min((times[b] for b in ("cublas", "quack") if b in times), default=None)
    for impl, us in times.items():
        res.add(
            name,
            impl,
            us,
            m=t,
            n=n,
            k=k,
            tiles=tiles if impl == "megakernel" else "",
            tflops=round(flops / us / 1e6, 1),
            of_best=round(best / us, 3) if best else "",
            of_floor=round(fl / us, 3),
            rel_err=round(errs[impl], 5),
        )
        if impl == "megakernel" and not errs[impl] <= 1e-2:
            res.meta.setdefault("failures", []).append(name)
            print(f"WARNING {name} megakernel: rel_err {errs[impl]:.3g}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", default=[], help="keep cases whose name contains any")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--quick", action="store_true", help="fewer timed runs (3 warm-up, 10 timed)")
    p.add_argument("--quack-tuned", action="store_true", help="let quack autotune each shape")
    args = p.parse_args(argv)
    cases = case_list(tuple(args.tokens), args.cases)
    if not cases:
        p.error(f"no case matches {args.cases}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    warmup, rep = (3, 10) if args.quick else (10, 50)
    quack_gemm = load_quack()
    res = Results(
        "gemm",
        meta={"dtype": "bf16", "quack": quack_gemm is not None, "quack_tuned": args.quack_tuned},
    )
    mk_gemms = MegakernelGemms(max(max(c[1] for c in cases), DECODE_MAX_TOKENS + 1))
    for case in cases:
        run_case(res, case, mk_gemms, quack_gemm, args.quack_tuned, warmup, rep)
        gc.collect()
        torch.cuda.empty_cache()
    path = res.finish()
    chart = bar_chart(res, path.with_suffix(".png"), key="tflops", log=False)
    if chart:
        print(f"wrote {chart}")
    return 1 if res.meta.get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
