import json
import os

import pytest

from cutemk.bench import (
    Results,
    bar_chart,
    floor_us,
    parse_variants,
    time_rounds,
    time_us,
    with_env,
)


def test_results_json_convention(tmp_path, capsys):
    r = Results("unit", meta={"shape": [4, 4]})
    r.add("n=4", "torch", 2.0)
    r.add("n=4", "cutemk", 1.0, tasks=3)
    r.add_ratios("torch")
    path = r.finish(tmp_path)
    doc = json.loads(path.read_text())
    assert set(doc) >= {"gpu", "versions", "commit", "meta", "rows"}
    assert doc["rows"][1] == {
        "case": "n=4",
        "impl": "cutemk",
        "median_us": 1.0,
        "tasks": 3,
        "speedup_vs_torch": 2.0,
    }
    assert "speedup_vs_torch" in capsys.readouterr().out


def test_timed_rows_carry_their_floor():
    r = Results("unit")
    row = r.add_timed("T=1", "cutemk", 80.0, 70.0, flops=8.0e9, rel_err=0.002)
    assert list(row.items()) == [
        ("case", "T=1"),
        ("impl", "cutemk"),
        ("median_us", 80.0),
        ("tflops", 100.0),  # 8 GFLOP in 80 us
        ("floor_us", 70.0),
        ("of_floor", 0.875),
        ("rel_err", 0.002),
    ]
    assert "tflops" not in r.add_timed("T=1", "torch", 100.0, 70.0)


def test_floor_and_timer():
    assert floor_us(flops=790e12) == 1e6
    assert floor_us(nbytes=4.3e12, flops=1.0) == 1e6
    calls = []
    assert time_us(lambda: calls.append(1), warmup=2, rep=5) >= 0
    assert len(calls) == 7


def test_bar_chart(tmp_path):
    pytest.importorskip("matplotlib")
    r = Results("unit")
    for case in ("T=1", "T=8192"):
        r.add(case, "torch", 2.0)
        r.add(case, "cutemk", 1.0)
    path = bar_chart(r, tmp_path / "unit.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_add_trace_summarises_a_profile(tmp_path, capsys):
    r = Results("unit")
    recs = [
        {"sm": 0, "start_ns": 1000, "end_ns": 3000, "label": "a[0]", "node": "a"},
        {"sm": 1, "start_ns": 1500, "end_ns": 2500, "label": "a[1]", "node": "a"},
        {"sm": 0, "start_ns": 4000, "end_ns": 9000, "label": "b[0]", "node": "b"},
    ]
    summary = r.add_trace("T=1", recs)
    assert [row["node"] for row in summary] == ["a", "b"]
    assert summary[0]["tasks"] == 2 and summary[0]["sms"] == 2
    assert summary[1]["first_start_us"] == 3.0 and summary[1]["last_end_us"] == 8.0
    doc = json.loads(r.finish(tmp_path).read_text())
    assert doc["meta"]["trace"]["T=1"] == summary
    assert "T=1: per-node trace" in capsys.readouterr().out


def test_launch_summary_accounts_for_the_time_outside_tasks():
    """Two SMs: CTAs enter at 0 and 1 us, tasks run 2-6 and 3-5 us, roles are done at 7 us,
    the last CTA leaves at 9 us."""
    from cutemk.trace import launch_summary

    us = 1000
    records = [
        {"sm": 0, "start_ns": 2 * us, "end_ns": 6 * us, "node": "a"},
        {"sm": 1, "start_ns": 3 * us, "end_ns": 5 * us, "node": "b"},
    ]
    ctas = [
        {"sm": 0, "entry_ns": 0, "roles_done_ns": 7 * us, "exit_ns": 8 * us},
        {"sm": 1, "entry_ns": 1 * us, "roles_done_ns": 6 * us, "exit_ns": 9 * us},
    ]
    s = launch_summary(records, ctas, num_sms=2)
    assert s == {
        "ctas": 2,
        "entry_spread_us": 1.0,
        "entry_to_first_task_us": 2.0,
        "task_span_us": 4.0,
        "sm_busy_share": 0.75,
        "last_task_to_roles_done_us": 1.0,
        "last_task_to_exit_us": 3.0,
    }
    assert launch_summary([], ctas, 2) == {}


def test_variants_compile_under_their_environment(monkeypatch):
    assert parse_variants(["ring3:CUTEMK_RING_STAGES=3,X=1"]) == {
        "ring3": {"CUTEMK_RING_STAGES": "3", "X": "1"}
    }
    for bad in ("ring3", ":A=1", "ring3:A", "ring3:=1"):
        with pytest.raises(ValueError, match="NAME:VAR=VALUE"):
            parse_variants([bad])
    monkeypatch.setenv("CUTEMK_X", "outer")
    monkeypatch.delenv("CUTEMK_Y", raising=False)
    env = {"CUTEMK_X": "inner", "CUTEMK_Y": "1"}
    seen = with_env(env, lambda: (os.environ["CUTEMK_X"], os.environ["CUTEMK_Y"]))()
    assert seen == ("inner", "1")
    assert os.environ["CUTEMK_X"] == "outer" and "CUTEMK_Y" not in os.environ


def test_time_rounds_rotates_the_order():
    """Every implementation timed once a round, the order rotated by one each round (eager
    implementations: no CUDA graph, so this runs on the CPU)."""
    seen = []
    impls = {n: (lambda n=n: seen.append(n)) for n in "abc"}
    out = time_rounds(impls, set(impls), warmup=0, rep=1, rounds=4)
    assert seen == list("abcbcacababc")
    assert list(out) == list("abc") and all(len(v) == 4 and min(v) >= 0 for v in out.values())


def _phased(sm, fetched, armed, ready, start, landed, staged, end, node="g"):
    """A task record with its phases, times in us (None: not stamped)."""

    def ns(us):
        return None if us is None else round(us * 1000)

    return {
        "sm": sm,
        "start_ns": ns(start),
        "end_ns": ns(end),
        "label": f"{node}[{sm}]",
        "node": node,
        "fetched_ns": ns(fetched),
        "armed_ns": ns(armed),
        "ready_ns": ns(ready),
        "landed_ns": ns(landed),
        "staged_ns": ns(staged),
    }


def test_task_records_carry_their_phases():
    """A raw profile row -> record: the SM out of the SM-and-node word, the phases' columns,
    an unstamped one (0) as None."""
    from types import SimpleNamespace

    from cutemk.codegen.layout import PROF_WIDTH
    from cutemk.trace import PHASES, task_record

    task = SimpleNamespace(label="gemm[3, 0]", node=SimpleNamespace(name="gemm"))
    row = [(5 << 32) | 7, 2000, 9000, 700, 500, 1500, 3000, 8000]  # node 5 on SM 7
    assert len(row) == PROF_WIDTH
    rec = task_record(row, task)
    assert rec == {
        "sm": 7,
        "start_ns": 2000,
        "end_ns": 9000,
        "label": "gemm[3, 0]",
        "node": "gemm",
        "fetched_ns": 500,
        "armed_ns": 700,
        "ready_ns": 1500,
        "landed_ns": 3000,
        "staged_ns": 8000,
    }
    simt = task_record([(2 << 32) | 131, 2000, 9000, 600, 500, 1500, 0, 0], task)
    assert simt["sm"] == 131
    assert [simt[k] for k in PHASES] == [500, 600, 1500, None, None]


def test_node_summary_splits_a_task_into_its_phases(tmp_path):
    """Per task: its early loads armed (waiting for free slots), its events met, queued until
    its consumers took it, its first slice late by 2 (or about at once: landed before they
    took it), streamed, stored. Per node the medians, and when its first and last task were
    ready."""
    from cutemk.trace import PHASES, chrome_trace, node_summary, task_gaps

    a = _phased(0, fetched=0, armed=0.5, ready=1, start=2, landed=4, staged=10, end=11)
    b = _phased(1, fetched=0, armed=2, ready=3, start=3, landed=3, staged=9, end=9.5)
    c = _phased(2, fetched=1, armed=1, ready=2, start=6, landed=8, staged=12, end=13)
    assert task_gaps(a) == {
        "slots_us": 0.5,
        "wait_us": 0.5,
        "queued_us": 1.0,
        "first_slice_us": 2.0,
        "stream_us": 6.0,
        "store_us": 1.0,
    }
    assert task_gaps(b)["first_slice_us"] == 0.0  # its slices had landed before it started
    simt = _phased(3, 4, 4, 5, start=5, landed=None, staged=None, end=7, node="s")
    assert task_gaps(simt) == {"slots_us": 0.0, "wait_us": 1.0, "queued_us": 0.0}
    rows = {r["node"]: r for r in node_summary([a, b, c, simt])}
    g = rows["g"]
    assert (g["first_ready_us"], g["last_ready_us"]) == (-1.0, 1.0)  # since the first start
    assert (g["median_slots_us"], g["median_wait_us"]) == (0.5, 1.0)
    assert g["median_queued_us"] == 1.0
    assert (g["median_first_slice_us"], g["median_stream_us"]) == (2.0, 6.0)
    assert "median_stream_us" not in rows["s"] and rows["s"]["median_wait_us"] == 1.0
    assert (g["last_task"], g["last_task_sm"]) == ("g[2]", 2)  # c ends last, at 13 us
    # the longest task beside the median: a ends at 11 after starting at 2 (c runs 7)
    assert (g["median_task_us"], g["longest_task_us"], g["longest_task"]) == (7.0, 9.0, "g[0]")
    assert g["last_task_gaps_us"] == {
        "slots_us": 0.0,
        "wait_us": 1.0,
        "queued_us": 4.0,
        "first_slice_us": 2.0,
        "stream_us": 4.0,
        "store_us": 1.0,
    }
    # records of a kernel without the phases summarise as before
    plain = [{k: v for k, v in a.items() if k not in PHASES}]
    assert "first_ready_us" not in node_summary(plain)[0]
    spans = [e for e in chrome_trace([a, simt])["traceEvents"] if e["ph"] == "X"]
    assert spans[0]["args"]["stream_us"] == 6.0 and "stream_us" not in spans[1]["args"]


def test_slice_regions_are_sized_by_the_busiest_queue_and_read_back_per_cta():
    """``profile="slices"``: a CTA's region holds the most slices its static queue can take
    (dynamic: every ring task's); the host reads each CTA's stamped slices in ring order."""
    import numpy as np

    from cutemk.codegen.layout import PROF_WIDTH, SLICE_WIDTH
    from cutemk.codegen.lower import R_NODE, REC_WIDTH
    from cutemk.codegen.profiling import (
        profile_words,
        record_words,
        slice_capacity,
        slice_records,
    )

    # nodes: 0 a ring op of 5 slices, 1 a SIMT op, 2 a ring op of 3 slices; 3 CTAs' queues
    ring_slices = [5, 0, 3]
    queues = [[0, 0, 1], [2, 1], []]
    ptr = np.cumsum([0] + [len(q) for q in queues])
    rec = np.zeros((5, REC_WIDTH), dtype=np.int32)
    rec[:, R_NODE] = [n for q in queues for n in q]
    assert slice_capacity(ring_slices, ptr, rec.reshape(-1), [2, 2, 1]) == 10
    no_queues = np.zeros(4, dtype=np.int64)
    assert slice_capacity(ring_slices, no_queues, rec[:1].reshape(-1), [2, 2, 1]) == 13
    assert slice_capacity([0], no_queues, rec[:1].reshape(-1), [4]) == 1  # never empty
    # dynamic at scale: twice a CTA's share of every ring slice, plus the longest task's
    many = np.zeros(133, dtype=np.int64)
    assert slice_capacity([64, 0, 16], many, rec[:1].reshape(-1), [128, 12, 256]) == (
        2 * -(-(64 * 128 + 16 * 256) // 132) + 64
    )
    # the host reads the task and CTA records back as rows whatever the slice regions' size
    # (3 CTAs x 3 slices: an odd number of slice words)
    from types import SimpleNamespace

    import torch

    from cutemk.profiles import ProfileReaders

    reader = ProfileReaders()
    reader.num_sms = 3
    prof = torch.arange(profile_words(5, 3, 3), dtype=torch.int64)
    b = SimpleNamespace(plan=SimpleNamespace(num_tasks=5), torch_dev={"prof": prof})
    rows = reader._profile_rows(b)
    assert rows.shape == (5 + 3, PROF_WIDTH)
    assert rows[-1, -1] == record_words(5, 3) - 1  # the slice regions are not read

    tasks, grid, cap = 5, 3, 10
    raw = np.zeros(profile_words(tasks, grid, cap), dtype=np.int64)
    region = (tasks + grid) * PROF_WIDTH
    assert raw.size == region + grid * cap * SLICE_WIDTH

    def stamp(cta, count, task, issued, landed, phases=0):
        at = region + (cta * cap + count) * SLICE_WIDTH
        raw[at : at + 4] = issued, landed, task, phases

    stamp(0, 0, 2, 100, 150, 7)
    stamp(0, 1, 2, 120, 0)  # issued, never seen landed
    stamp(1, 0, 4, 90, 400)
    assert slice_records(raw, grid, tasks) == [
        [(0, 2, 100, 150, 7), (1, 2, 120, 0, 0)],
        [(0, 4, 90, 400, 0)],
        [],
    ]


def test_phase_words_pack_and_unpack_by_field():
    """A slice's ``phases`` word: ``PHASE_FIELDS`` cycle counts of ``PHASE_BITS`` each, lowest
    first, saturated; the host unpacks what the device packs (``pack_phases``)."""
    from cutemk.codegen.profiling import PHASE_BITS, PHASE_FIELDS, PHASE_MAX, unpack_phases

    assert PHASE_BITS * len(PHASE_FIELDS) <= 63
    vals = [5, PHASE_MAX, 0, 1234, 77]
    word = sum(v << (PHASE_BITS * i) for i, v in enumerate(vals))
    assert unpack_phases(word) == dict(zip(PHASE_FIELDS, vals))


def test_slice_summary_reads_latency_and_the_gaps_between_slices():
    from cutemk.trace import slice_summary

    tasks = [  # ns: issued every 100, landing 1000 later, then every 200 (consumer-bound)
        {"node": "g", "label": "g[0]", "sm": 0, "slices": [(0, 1000), (100, 1200), (200, 1400)]},
        {"node": "g", "label": "g[1]", "sm": 1, "slices": [(0, 1000), (100, 1200), (200, 0)]},
        {"node": "h", "label": "h[0]", "sm": 0, "slices": [(5000, 5500)]},
    ]
    rows = {r["node"]: r for r in slice_summary(tasks)}
    assert rows["g"] == {
        "node": "g",
        "tasks": 2,
        "slices_per_task": 3,
        "latency_us": 1.1,
        "issue_gap_us": 0.1,
        "landed_gap_us": 0.2,
    }
    assert rows["h"]["issue_gap_us"] is None and rows["h"]["latency_us"] == 0.5


def test_slice_summary_adds_the_median_phases_of_tiles_that_stamp_them():
    from cutemk.codegen.profiling import PHASE_BITS, PHASE_FIELDS
    from cutemk.trace import slice_summary

    def word(*vals):
        return sum(v << (PHASE_BITS * i) for i, v in enumerate(vals))

    slices = [(0, 1000), (100, 1200), (200, 1400)]
    tasks = [
        {"node": "a", "slices": slices, "phases": [word(10, 20, 300, 400, 5)] * 2 + [0]},
        {"node": "a", "slices": slices, "phases": [word(30, 0, 310, 420, 9)]},
        {"node": "g", "slices": slices, "phases": [0, 0, 0]},
    ]
    rows = {r["node"]: r for r in slice_summary(tasks)}
    assert rows["a"]["phase_cycles"] == dict(zip(PHASE_FIELDS, (10, 20, 300, 400, 5)))
    assert rows["a"]["phase_slices"] == 3  # the unstamped slice is not one of them
    assert "phase_cycles" not in rows["g"]


def test_profile_levels():
    import torch

    import cutemk as mk
    from cutemk.kernels import kernel_spec
    from cutemk.layers import mlp_graph

    g = mlp_graph(mk.sym("T", max=64), 256, 256, torch.bfloat16, 64, 64)
    assert not kernel_spec(g, False, profile=True).profile_slices
    spec = kernel_spec(g, False, profile="slices")
    assert spec.profile and spec.profile_slices
    with pytest.raises(ValueError, match="profile must be"):
        kernel_spec(g, False, profile="slice")


def test_code_size_measures_one_op_kernels(benchmark_script):
    """``benchmarks/code_size.py``: a node's op stands alone as a graph of its arguments, and
    a kernel's SASS bytes grow with the op it runs (a norm's body over a one-row add's)."""
    import shutil

    import pytest

    if shutil.which("ptxas") is None:
        pytest.skip("ptxas is not installed")
    import torch

    import cutemk as mk
    from cutemk import ops

    cs = benchmark_script("code_size")
    g = mk.Graph("norm")
    x = g.input("x", (mk.sym("T", max=4), 2048), torch.bfloat16)
    w = g.weight("w", (2048,), torch.bfloat16)
    g.output(g.call(ops.rmsnorm, x, w, block_m=1, name="n"), "y")
    alone = cs.one_op_graph(g.nodes[0])
    assert [n.name for n in alone.nodes] == ["n"] and len(alone.outputs) == 1
    base = cs.text_bytes(cs.baseline_graph())
    assert 4096 < base < cs.text_bytes(alone)


def test_small_tasks_chain_matches_torch(benchmark_script):
    """``benchmarks/small_tasks.py``'s chain (norm, then add, a link) on the interpreter, with
    the concurrent GEMV: the chain's result comes back first and matches torch in fp32."""
    import torch

    st = benchmark_script("small_tasks")
    g = st.chain_graph(3, 256, stream_mb=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=gen)
    ws = {f"w{i}": 1 + 0.1 * torch.randn(256, generator=gen) for i in range(3)}
    xs = torch.randn(2, st.STREAM_K, generator=gen)
    w_s = torch.randn(st.stream_rows(1), st.STREAM_K, generator=gen)
    bf = {k: v.bfloat16() for k, v in ws.items()}
    x, xs, w_s = x.bfloat16(), xs.bfloat16(), w_s.bfloat16()
    y, ys = g.compile("interpret", scheduler="static")(x, xs=xs, ws=w_s, **bf)
    want = x.float()
    for i in range(3):  # each op's output rounded to bf16, as the graph stores it
        w = bf[f"w{i}"].float()
        n = (want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6) * w).bfloat16()
        want = (n.float() + want).bfloat16().float()
    assert torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.allclose(ys.float(), xs.float() @ w_s.float().T, rtol=2e-2, atol=0.5)


def test_sass_loops_finds_backward_branches_and_counts_their_opcodes(benchmark_script):
    sl = benchmark_script("sass_loops")
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/              @!P0 MUFU.EX2 R2, R3 ;
        /*0030*/                   FMUL R4, R4, R5 ;
.L_x_2:
        /*0040*/                   FADD R6, R6, R7 ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/               @P2 BRA `(.L_x_1) ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0080*/                   EXIT ;
"""
    found = {(s, e): ops for s, e, ops in sl.loops(sass)}
    # two backward branches (the forward one to .L_x_3 is no loop)
    assert set(found) == {(0x40, 0x50), (0x10, 0x60)}
    outer = found[(0x10, 0x60)]
    assert outer == {"HGMMA": 1, "MUFU": 1, "FMUL": 1, "FADD": 1, "BRA": 2}
    assert found[(0x40, 0x50)] == {"FADD": 1, "BRA": 1}
    assert sl.opcode("@!P0 MUFU.EX2 R2, R3") == "MUFU"
