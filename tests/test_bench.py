import json

import pytest

from cutemk.bench import Results, bar_chart, floor_us, time_us


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
