"""Host path of the drop-in modules: what a new token count, an eager call and a fresh process
cost on the host, for the Qwen3-30B-A3B MoE block and the Qwen3-8B MLP at real size.

Sections (``--sections``, all by default):

- ``plan`` (no GPU needed): the regime graph ``MegaMoE`` / ``MegaMLP`` compiles for each token
  count (``cutemk.nn.moe_regime_graph`` / ``mlp_regime_graph``), planned at that count:
  instantiate, static schedule + its deadlock check, lowering (static and dynamic); best of
  ``--repeat`` runs, with the task count. ``static_ms`` / ``dynamic_ms`` is what the first
  call at a new count pays before its launch (the target: at most 50 ms at T=4096).
- ``first`` (GPU): the first call of each module at real size at T=4096 after a warm call
  at 4095 (kernel compiled), end to end and synchronized, minus a warm call at 4096: what a
  new count costs in a server, both schedulers (target: at most 50 ms).
- ``eager`` (GPU): host time of one eager call (no CUDA graph) of a small ``MegaMLP`` and a
  small ``MegaMoE`` (the kernels are tiny): host time of back-to-back calls in chunks
  (``cutemk.bench.host_us``), against one torch kernel launch (``torch.add``) timed the same
  way, and the MLP's CUDA-graph replay for reference (target: at most 15 us).
- ``warmup`` (GPU): a fresh process builds both modules at real size and runs
  ``cutemk.warmup`` on both (every regime's kernel compiled, in parallel worker processes,
  then loaded by one launch; the ``--warm-tokens`` planned), twice against one empty on-disk
  compile cache: cold, then cached (targets: 30 s cold and 2 s cached for every T up to 4096;
  with plans per token count, the counts given). The rows split the process's time into
  imports, building the modules (their weights) and the warm-up itself.

- ``capture`` (GPU): the Qwen3-8B ``MegaMLP`` and the Qwen3-30B-A3B ``MegaMoE`` (``--capture-
  models``) taking their token count as device data (``forward_live``), each captured in one
  CUDA graph and replayed at ``--capture-tokens`` in random order, each against a graph
  captured for that count (target: within 10%); the time to compile the live kernels and
  plan every count they serve. The counts between two planned ones (5, 9, 17, 37) run the
  larger plan: what that costs is the point of them.

Run: python benchmarks/host_path.py [--sections plan first eager capture warmup] [--tokens 1 16
128 1024 4096] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import cutemk.nn.base
from cutemk.bench import Results, host_us, host_us_queued, plan_stages
from cutemk.regimes import (
    MOE_REGIME_LIMITS,
    REGIME_LIMITS,
    mlp_regime_graph,
    moe_regime_graph,
    regime_of,
)

NUM_SMS = 132
MOE = {"hidden": 2048, "intermediate": 768, "num_experts": 128, "top_k": 8}  # Qwen3-30B-A3B
MLP = {"hidden": 4096, "intermediate": 12288}  # Qwen3-8B
MAX_TOKENS = 4096


def _graphs(model: str):
    """token count -> the regime graph the module runs it with (built once per regime)."""
    built: dict[str, object] = {}

    def of(t: int):
        if model == "moe":
            regime = regime_of(MOE_REGIME_LIMITS, t)
            if regime not in built:
                built[regime] = moe_regime_graph(
                    **MOE,
                    norm_topk_prob=True,
                    regime=regime,
                    dtype=torch.bfloat16,
                    max_tokens=MAX_TOKENS,
                )
        else:
            regime = regime_of(REGIME_LIMITS, t)
            if regime not in built:
                built[regime] = mlp_regime_graph(
                    **MLP, regime=regime, dtype=torch.bfloat16, max_tokens=MAX_TOKENS
                )
        return regime, built[regime]

    return of


def plan_section(res: Results, tokens: list[int], repeat: int) -> None:
    for model in ("moe", "mlp"):
        graph_of = _graphs(model)
        for t in tokens:
            regime, g = graph_of(t)
            g.validate()
            plan_stages(g, {"T": min(t, 16)}, NUM_SMS)  # imports and caches warm
            runs = [plan_stages(g, {"T": t}, NUM_SMS) for _ in range(repeat)]
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            static = best["instantiate"] + best["schedule"] + best["lower_static"]
            dynamic = best["instantiate"] + best["lower_dynamic"]
            res.add(
                f"plan {model} T={t}",
                "static",
                1e3 * static,
                regime=regime,
                tasks=int(best["tasks"]),
                static_ms=round(static, 2),
                dynamic_ms=round(dynamic, 2),
                **{k: round(v, 2) for k, v in best.items() if k != "tasks"},
            )
            print(f"plan {model} T={t} ({regime}): {static:.1f} ms static, {dynamic:.1f} dynamic")


def eager_section(res: Results, calls: int) -> None:
    from cutemk.bench import graphed, small_mlp, time_us

    mlp, x = small_mlp()
    h, i = mlp.hidden, mlp.intermediate
    a = torch.randn_like(x, dtype=torch.float32)
    mk_us = host_us(lambda: mlp(x), calls)
    cutemk.nn.base.FAST_PATH = False  # the same module's full path, for the fast path's gain
    try:
        full_us = host_us(lambda: mlp(x), calls)
    finally:
        cutemk.nn.base.FAST_PATH = True
    torch_us = host_us(lambda: torch.add(a, a), calls)
    replay = time_us(graphed(lambda: mlp(x)), cold_l2=False)
    # the same calls queued behind a busy GPU: the host's own cost, whatever the GPU's pace
    graph = mlp.compiled(mlp.regime(x.shape[0]))
    wgu, wd = mlp.w_gate_up, mlp.w_down
    q_mk = host_us_queued(lambda: mlp(x))
    q_graph = host_us_queued(lambda: graph(x, wgu, wd))
    q_torch = host_us_queued(lambda: torch.add(a, a))
    case = f"eager MegaMLP h={h} i={i} T=8"
    res.add(case, "cutemk_eager_host", mk_us, target_us=15.0)
    res.add(case, "cutemk_eager_host_full_path", full_us)
    res.add(case, "torch_add_host", torch_us)
    res.add(case, "cutemk_graph_replay", replay)
    res.add(case, "cutemk_eager_host_gpu_busy", q_mk, target_us=15.0)
    res.add(case, "cutemk_graph_call_host_gpu_busy", q_graph)
    res.add(case, "torch_add_host_gpu_busy", q_torch)
    print(
        f"eager call: {mk_us:.1f} us host ({full_us:.1f} without the fast path; torch.add "
        f"{torch_us:.1f} us), replay {replay:.1f} us"
    )
    print(
        f"with the GPU busy: module {q_mk:.1f} us, graph call {q_graph:.1f} us, "
        f"torch.add {q_torch:.1f} us"
    )
    # a small MegaMoE the same way (the same fast path since the modules share it)
    from cutemk.nn import MegaMoE

    g = torch.Generator(device="cuda").manual_seed(1)
    e, mh, mi = 8, 256, 128

    def rw(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).bfloat16()

    moe = MegaMoE(rw(e, mh), rw(e, 2 * mi, mh), rw(e, mh, mi), top_k=2, max_tokens=64)
    xm = torch.randn(8, mh, device="cuda", generator=g).bfloat16()
    moe(xm)
    moe_us = host_us(lambda: moe(xm), calls)
    cutemk.nn.base.FAST_PATH = False
    try:
        moe_full_us = host_us(lambda: moe(xm), calls)
    finally:
        cutemk.nn.base.FAST_PATH = True
    moe_case = f"eager MegaMoE h={mh} i={mi} e={e} k=2 T=8"
    res.add(moe_case, "cutemk_eager_host", moe_us, target_us=15.0)
    res.add(moe_case, "cutemk_eager_host_full_path", moe_full_us)
    res.add(moe_case, "torch_add_host", torch_us)
    print(f"eager MegaMoE: {moe_us:.1f} us host ({moe_full_us:.1f} without the fast path)")
    # the same module without the cooperative launch attribute (a module of another key,
    # compiled with CUTEMK_COOPERATIVE=0): what the co-residency guarantee costs a launch
    want = mlp(x).float()
    os.environ["CUTEMK_COOPERATIVE"] = "0"
    try:
        plain, xp = small_mlp(max_tokens=65)
        got = plain(xp).float()
        plain_us = host_us(lambda: plain(xp), calls)
        plain_replay = time_us(graphed(lambda: plain(xp)), cold_l2=False)
    finally:
        os.environ.pop("CUTEMK_COOPERATIVE")
    same = torch.equal(got, want)
    res.add(case, "cutemk_eager_host_not_cooperative", plain_us, same_result=same)
    res.add(case, "cutemk_graph_replay_not_cooperative", plain_replay)
    print(
        f"not cooperative: eager {plain_us:.1f} us host, replay {plain_replay:.1f} us "
        f"(result {'identical' if same else 'DIFFERENT'})"
    )


def first_call_section(res: Results, tokens: int = MAX_TOKENS, seed: int = 0) -> None:
    """What the first call at a new token count costs over a warm call at that count, end to
    end on the host (plan, device state, launch; synchronized), for both modules at real size
    and both schedulers; the kernel is compiled and warm at another count first."""
    from cutemk.nn import MegaMLP, MegaMoE

    torch.manual_seed(seed)
    dt = torch.bfloat16

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda") / shape[-1] ** 0.5).to(dt)

    e, h, i = MOE["num_experts"], MOE["hidden"], MOE["intermediate"]
    moe_w = (rnd(e, h), rnd(e, 2 * i, h), rnd(e, h, i))
    mh, mi = MLP["hidden"], MLP["intermediate"]
    mlp_w = (rnd(mi, mh), rnd(mi, mh), rnd(mh, mi))
    for sched in ("static", "dynamic"):
        mods = {
            "moe": MegaMoE(*moe_w, top_k=MOE["top_k"], max_tokens=MAX_TOKENS, scheduler=sched),
            "mlp": MegaMLP(*mlp_w, max_tokens=MAX_TOKENS, scheduler=sched),
        }
        for name, m in mods.items():
            x = torch.randn(tokens, m.hidden, device="cuda").to(dt)
            m(x[: tokens - 1])  # the regime's kernel compiled, another count planned
            torch.cuda.synchronize()
            times = []
            for _ in range(3):  # first, then warm calls at the new count
                t0 = time.perf_counter()
                m(x)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            first_ms, warm_ms = 1e3 * times[0], 1e3 * min(times[1:])
            res.add(
                f"first call {name} T={tokens}",
                sched,
                1e3 * (first_ms - warm_ms),
                first_ms=round(first_ms, 2),
                warm_ms=round(warm_ms, 2),
                target_ms=50.0,
            )
            print(
                f"first call {name} T={tokens} {sched}: {first_ms:.1f} ms, warm {warm_ms:.2f} "
                f"ms: +{first_ms - warm_ms:.1f} ms"
            )
        del mods
        torch.cuda.empty_cache()


def capture_section(
    res: Results,
    tokens: list[int],
    models: list[str] = ("mlp", "moe"),
    seed: int = 0,
    pdl: bool = False,
) -> None:
    """One CUDA graph of a module taking its token count as device data (``forward_live``:
    the Qwen3-8B MegaMLP, the Qwen3-30B-A3B MegaMoE), captured once and replayed at each
    count in random order, against a graph captured for that count (the module's ordinary
    call). ``pdl``: also the same module with its live kernels launched with programmatic
    dependent launch (``CUTEMK_LIVE_PDL=1``), captured once beside it."""
    import os
    import random

    from cutemk.bench import graphed, time_us
    from cutemk.nn import MegaMLP, MegaMoE

    torch.manual_seed(seed)
    dt = torch.bfloat16

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda") / shape[-1] ** 0.5).to(dt)

    for model in models:
        if model == "mlp":
            h, i = MLP["hidden"], MLP["intermediate"]
            label = "MegaMLP 8B"
            weights = (rnd(i, h), rnd(i, h), rnd(h, i))

            def build(weights=weights):
                return MegaMLP(*weights, max_tokens=MAX_TOKENS)
        else:
            e, h, i = MOE["num_experts"], MOE["hidden"], MOE["intermediate"]
            label = "MegaMoE 30B-A3B"
            weights = (rnd(e, h), rnd(e, 2 * i, h), rnd(e, h, i))

            def build(weights=weights):
                return MegaMoE(*weights, top_k=MOE["top_k"], max_tokens=MAX_TOKENS)

        mod = build()
        x = torch.randn(MAX_TOKENS, h, device="cuda").to(dt)
        n = torch.full((1,), MAX_TOKENS, dtype=torch.int32, device="cuda")
        t0 = time.perf_counter()
        mod(x, num_tokens=n)  # every regime's live kernel compiled, every planned count planned
        torch.cuda.synchronize()
        prepare_s = time.perf_counter() - t0
        counts = sum(len(live.counts) for _, live in mod.live_graphs())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mod(x, num_tokens=n)
        graph_p = None
        if pdl:  # the same weights; its live kernels compile with the switch on
            mod_p = build()
            os.environ["CUTEMK_LIVE_PDL"] = "1"  # live graphs are looked up by the switch
            try:
                mod_p(x, num_tokens=n)
                torch.cuda.synchronize()
                graph_p = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph_p):
                    y_p = mod_p(x, num_tokens=n)
                assert all(live.spec.live_pdl for _, live in mod_p.live_graphs(build=False))
            finally:
                del os.environ["CUTEMK_LIVE_PDL"]
        order = list(tokens)
        random.Random(seed).shuffle(order)
        for t in order:
            n.fill_(t)
            live_us = time_us(graph.replay)
            graph.replay()
            got = y[:t].float()
            want = mod(x[:t]).float()  # the launch planned for t
            planned_us = time_us(graphed(lambda t=t, m=mod: m(x[:t])))
            diff = (got - want).abs().max().item()
            case = f"capture-once {label} T={t}"
            ratio = live_us / planned_us
            res.add(
                case,
                "cutemk_live_replay",
                live_us,
                planned_us=round(planned_us, 2),
                ratio=round(ratio, 3),
                target_ratio=1.10,
                max_abs_diff=diff,
                prepare_s=round(prepare_s, 2),
                planned_counts=counts,
                plan_count=mod.live_plan_count(t),
            )
            res.add(case, "cutemk_planned_replay", planned_us)
            if graph_p is not None:
                pdl_us = time_us(graph_p.replay)
                graph_p.replay()
                same = bool(torch.equal(y_p[:t], y[:t]))
                res.add(
                    case,
                    "cutemk_live_pdl_replay",
                    pdl_us,
                    ratio=round(pdl_us / planned_us, 3),
                    target_ratio=1.10,
                    same_result=same,
                )
                print(f"    with programmatic dependent launch: {pdl_us:.1f} us, same: {same}")
            print(
                f"capture-once {label} T={t} (plan {mod.live_plan_count(t)}): {live_us:.1f} us "
                f"replay vs {planned_us:.1f} us planned for T ({ratio:.3f}x), max |diff| {diff:.3g}"
            )
        print(f"capture-once {label} prepare: {prepare_s:.1f} s ({counts} counts planned)")
        del mod, graph, y
        if graph_p is not None:
            del mod_p, graph_p, y_p
        torch.cuda.empty_cache()


_WARMUP_CHILD = """
import json, sys, time, torch
t0 = time.perf_counter()
import cutemk
from cutemk.nn import MegaMLP, MegaMoE
moe, mlp, tokens = json.loads(sys.argv[1])
t_import = time.perf_counter() - t0
dt = torch.bfloat16
e, h, i = moe["num_experts"], moe["hidden"], moe["intermediate"]
t0 = time.perf_counter()
mods = {
    "moe": MegaMoE(torch.randn(e, h, device="cuda", dtype=dt),
                   torch.randn(e, 2 * i, h, device="cuda", dtype=dt),
                   torch.randn(e, h, i, device="cuda", dtype=dt),
                   top_k=moe["top_k"], max_tokens=4096),
    "mlp": MegaMLP(torch.randn(mlp["intermediate"], mlp["hidden"], device="cuda", dtype=dt),
                   torch.randn(mlp["intermediate"], mlp["hidden"], device="cuda", dtype=dt),
                   torch.randn(mlp["hidden"], mlp["intermediate"], device="cuda", dtype=dt),
                   max_tokens=4096),
}
torch.cuda.synchronize()
out = {"import_s": t_import, "modules_s": time.perf_counter() - t0}
t0 = time.perf_counter()
report = cutemk.warmup(list(mods.values()), tokens=tokens, progress=False)
out["warmup_s"] = time.perf_counter() - t0
out["steps"] = len(report.steps)
out["parallel_compile_s"] = sum(s for n, s in report.steps if "in parallel" in n)
print("WARMUP " + json.dumps(out))
"""


def _warmup_child(cache_dir: str, tokens: list[int]) -> dict:
    env = dict(os.environ, CUTE_DSL_CACHE_DIR=cache_dir)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _WARMUP_CHILD, json.dumps([MOE, MLP, tokens])],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    line = next((s for s in proc.stdout.splitlines() if s.startswith("WARMUP ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"warm-up process failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    out = json.loads(line[len("WARMUP ") :])
    out["process_s"] = wall
    return out


def warmup_section(res: Results, tokens: list[int]) -> None:
    with tempfile.TemporaryDirectory(prefix="cutemk-cache-") as cache:
        for label in ("cold", "cached"):
            out = _warmup_child(cache, tokens)
            res.add(
                f"warmup moe+mlp, {len(tokens)} token counts planned",
                label,
                1e6 * out["process_s"],
                **{k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()},
            )
            print(f"warm-up {label}: {out['process_s']:.1f} s ({out})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["plan", "first", "eager", "capture", "warmup"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 1024, 4096])
    p.add_argument(
        "--warm-tokens",
        nargs="*",
        type=int,
        default=[1, 16, 128, 1024, 4096],
        help="token counts the warm-up plans",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats and calls")
    p.add_argument(
        "--capture-tokens",
        nargs="+",
        type=int,
        default=[1, 5, 9, 17, 37, 1000, 4096],
        help="token counts the capture-once graph replays at",
    )
    p.add_argument(
        "--live-pdl",
        action="store_true",
        help="capture: also the live kernels with programmatic dependent launch",
    )
    p.add_argument(
        "--capture-models",
        nargs="+",
        choices=["mlp", "moe"],
        default=["mlp", "moe"],
        help="modules the capture section captures once",
    )
    args = p.parse_args(argv)
    unknown = set(args.sections) - {"plan", "first", "eager", "capture", "warmup"}
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    gpu = torch.cuda.is_available()
    if not gpu and set(args.sections) - {"plan"}:
        print("no GPU: running the plan section only")
        args.sections = [s for s in args.sections if s == "plan"]
    res = Results(
        "host_path",
        meta={"num_sms": NUM_SMS, "moe": MOE, "mlp": MLP, "max_tokens": MAX_TOKENS},
    )
    if "plan" in args.sections:
        plan_section(res, args.tokens, 2 if args.quick else 5)
    if "first" in args.sections:
        first_call_section(res)
    if "eager" in args.sections:
        eager_section(res, 200 if args.quick else 2000)
    if "capture" in args.sections:
        capture_section(res, args.capture_tokens, args.capture_models, pdl=args.live_pdl)
    if "warmup" in args.sections:
        warmup_section(res, args.warm_tokens)
    res.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
