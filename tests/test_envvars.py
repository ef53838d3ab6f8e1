"""``CUTEMK_*`` variables with a value they do not take are errors naming the variable: an
"off" switch used to mean on, a typo'd choice nothing, a bad number a raw ``int()`` error."""

import subprocess
import sys

import pytest

import cutemk as mk
from cutemk import ops, runtime
from cutemk.envvars import env_choice, env_int, env_switch

N = mk.sym("N", max=64)
M = mk.sym("M", max=1 << 12)


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("0", False)])
def test_a_switch_takes_0_or_1(monkeypatch, value, on):
    monkeypatch.setenv("CUTEMK_X", value)
    assert env_switch("CUTEMK_X", True) is on


@pytest.mark.parametrize("value", ["off", "false", "no", "2", " 1"])
def test_a_switch_refuses_anything_else(monkeypatch, value):
    monkeypatch.setenv("CUTEMK_X", value)
    with pytest.raises(ValueError, match=r"CUTEMK_X=.*use 1 \(on\) or 0 \(off\)"):
        env_switch("CUTEMK_X", True)


def test_numbers_and_choices(monkeypatch):
    monkeypatch.setenv("CUTEMK_N", "2048")
    assert env_int("CUTEMK_N", 4096, minimum=1024, multiple=1024) == 2048
    for bad, match in [("abc", "whole number"), ("2.5", "whole number"), ("0", "at least 1024")]:
        monkeypatch.setenv("CUTEMK_N", bad)
        with pytest.raises(ValueError, match=f"CUTEMK_N=.*{match}"):
            env_int("CUTEMK_N", 4096, minimum=1024, multiple=1024)
    monkeypatch.setenv("CUTEMK_N", "1500")
    with pytest.raises(ValueError, match="a multiple of 1024"):
        env_int("CUTEMK_N", 4096, minimum=1024, multiple=1024)
    monkeypatch.setenv("CUTEMK_C", "tile")
    with pytest.raises(ValueError, match="CUTEMK_C='tile': use one of tiles, step"):
        env_choice("CUTEMK_C", ("tiles", "step"))


@pytest.mark.parametrize(
    "name",
    ["CUTEMK_COOPERATIVE", "CUTEMK_EARLY_HANDOVER", "CUTEMK_EPI_MBARRIER", "CUTEMK_QUEUE_HEAD"],
)
def test_the_kernel_switches_refuse_off(monkeypatch, name):
    """``off`` read as on: the kernel was built with the switch on and the spec said so."""
    g = ops.dag_graph([[], [0]], N, M)
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=name):
        runtime.kernel_spec(g, False)


def test_split_reduce_and_cache_size_refuse_typos(monkeypatch):
    from cutemk.kernels import cache_max_kernels
    from cutemk.regimes import split_reduce_in_tiles

    monkeypatch.setenv("CUTEMK_SPLIT_REDUCE", "tile")
    with pytest.raises(ValueError, match="CUTEMK_SPLIT_REDUCE"):
        split_reduce_in_tiles(True)
    monkeypatch.setenv("CUTEMK_CACHE_MAX_KERNELS", "-1")  # dropped the last kernel to compile
    with pytest.raises(ValueError, match="CUTEMK_CACHE_MAX_KERNELS=-1: expected at least 1"):
        cache_max_kernels()


def test_a_bad_smem_reserve_is_named_at_import():
    r = subprocess.run(
        [sys.executable, "-c", "import cutemk.kernels"],
        env={**__import__("os").environ, "CUTEMK_SMEM_RESERVED": "2.5"},
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "CUTEMK_SMEM_RESERVED='2.5': expected a whole number" in r.stderr
