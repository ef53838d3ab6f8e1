import json

import pytest

import os

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
