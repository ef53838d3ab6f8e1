"""The worker's shared-memory hand-overs in minimal kernels (``benchmarks/sanitize_patterns.py``):
they compile for sm_90a with the synchronisation they exist to show, and on a GPU every
round reads what the other side wrote."""

import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


@pytest.mark.parametrize(
    "name, present, absent",
    [
        ("named", [r"bar\.arrive\s+1, 64", r"bar\.sync\s+1, 64"], [r"mbarrier\.arrive"]),
        ("named_sync", [r"bar\.sync\s+1, 64", r"bar\.sync\s+2, 64"], [r"\bbar\.arrive"]),
        (
            "mbarrier",
            [r"mbarrier\.arrive", r"mbarrier\.try_wait", r"bar\.warp\.sync"],
            [r"mov\.b32\s+%r\d+, 32;\s+mbarrier\.init"],
        ),
        ("mbarrier_all", [r"mov\.b32\s+%r\d+, 32;\s+mbarrier\.init", r"mbarrier\.try_wait"], []),
        (
            "epi",
            [r"bar\.sync\s+1, 64", r"mbarrier\.arrive", r"mbarrier\.try_wait"],
            [r"\bbar\.arrive", r"nanosleep"],
        ),
        ("epi_late", [r"bar\.sync\s+1, 64", r"mbarrier\.try_wait", r"nanosleep"], []),
        ("named_skew", [r"bar\.sync\s+3, 32", r"bar\.sync\s+1, 64", r"bar\.sync\s+2, 64"], []),
        ("mbarrier_skew", [r"bar\.sync\s+3, 32", r"mbarrier\.try_wait"], [r"bar\.sync\s+1,"]),
        ("join", [r"bar\.sync\s+3, 32", r"bar\.sync\s+0;"], [r"mbarrier\.try_wait"]),
        (
            "worker",
            [r"barrier\.sync\s+1, 128", r"barrier\.sync\s+3, 288", r"barrier\.sync\s+5, 256"],
            [r"\bbar\.sync\s+\d+,", r"setmaxnreg"],
        ),
        ("worker_aligned", [r"\bbar\.sync\s+3, 288", r"\bbar\.sync\s+1, 128"], []),
        ("worker_nosimt", [r"barrier\.sync\s+3, 288"], [r"sync\s+1, 128"]),
        ("worker_nreg", [r"setmaxnreg\.dec", r"setmaxnreg\.inc", r"barrier\.sync\s+3, 288"], []),
        ("worker_one", [r"barrier\.sync\s+3, 288", r"barrier\.sync\s+1, 128"], []),
        ("worker_no5", [r"barrier\.sync\s+3, 288"], [r"sync\s+5, 256"]),
        ("worker_mbar", [r"mov\.b32\s+%r\d+, 256;\s+mbarrier\.init"], [r"sync\s+3, 288"]),
        ("worker_verdict", [r"barrier\.sync\s+5, 256"], [r"sync\s+3, 288"]),
        ("worker_red", [r"barrier\.red\.or\.pred\s+%p\d+, 5, 256"], [r"sync\s+3, 288"]),
        ("worker_wide", [r"barrier\.sync\s+2, 256"], [r"sync\s+3, 288"]),
    ],
)
def test_patterns_compile_with_their_synchronisation(
    tmp_path, name, present, absent, benchmark_script
):
    benchmark_script("sanitize_patterns").compile_pattern(name, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    for instr in present:
        assert re.search(instr, ptx), f"{name}: no {instr}"
    for instr in absent:
        assert not re.search(instr, ptx), f"{name}: unexpected {instr}"


@pytest.mark.gpu
def test_patterns_read_what_was_written(benchmark_script):
    assert benchmark_script("sanitize_patterns").main([]) == 0
