"""The on-disk kernel cache: a megakernel compiled once is loaded, not compiled, by the next
process (the key covers the kernel's spec, cutemk's source and the compiler's version); a
damaged file is compiled over; an empty ``CUTEMK_CACHE_DIR`` turns the cache off. CPU: compile,
export and load need no GPU; the GPU test launches a loaded kernel in a fresh process."""

import json
import os
import subprocess
import sys

import pytest
import torch

import cutemk as mk
from cutemk import runtime
from cutemk.layers import mlp_graph


def _spec(hidden=256):
    g = mlp_graph(mk.sym("T", max=512), hidden, 192, torch.bfloat16, 64, 64)
    return runtime.kernel_spec(g, False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTEMK_CACHE_DIR", str(tmp_path))
    yield tmp_path


def _forget(spec):
    runtime._COMPILED.pop(spec, None)


def test_second_compile_loads_from_disk(cache_dir):
    spec = _spec()
    _forget(spec)
    compiled, loaded = runtime.compile_count, runtime.cache_loads
    runtime._compile(spec)
    files = list(cache_dir.glob("megakernel-*.o"))
    assert len(files) == 1 and runtime.compile_count == compiled + 1
    _forget(spec)  # as a new process would start
    fn = runtime._compile(spec)
    assert runtime.compile_count == compiled + 1 and runtime.cache_loads == loaded + 1
    assert callable(fn) and type(fn).__name__ == "Function"  # TVM-FFI's, as compiled ones
    other = _spec(hidden=128)  # another kernel: another file
    _forget(other)
    runtime._compile(other)
    assert len(list(cache_dir.glob("megakernel-*.o"))) == 2
    _forget(spec)
    _forget(other)


def test_damaged_file_is_compiled_over(cache_dir):
    spec = _spec()
    _forget(spec)
    runtime._compile(spec)
    (path,) = cache_dir.glob("megakernel-*.o")
    path.write_bytes(b"not an object file")
    _forget(spec)
    compiled = runtime.compile_count
    with pytest.warns(UserWarning, match="ignoring the cached kernel"):
        runtime._compile(spec)
    assert runtime.compile_count == compiled + 1
    assert path.stat().st_size > 1000  # written again
    _forget(spec)


def test_least_recently_used_kernels_are_evicted(cache_dir, monkeypatch):
    monkeypatch.setenv("CUTEMK_CACHE_MAX_KERNELS", "2")
    specs = [_spec(hidden=h) for h in (64, 128, 256)]
    for s in specs:
        _forget(s)
    runtime._compile(specs[0])
    runtime._compile(specs[1])
    (first,) = [f for f in cache_dir.glob("megakernel-*.o") if f == runtime._cache_path(specs[0])]
    os.utime(first, (1, 1))  # long unused
    runtime._compile(specs[2])
    left = set(cache_dir.glob("megakernel-*.o"))
    assert left == {runtime._cache_path(specs[1]), runtime._cache_path(specs[2])}
    for s in specs:
        _forget(s)


def test_empty_cache_dir_turns_the_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTEMK_CACHE_DIR", "")
    assert runtime.kernel_cache_dir() is None
    monkeypatch.delenv("CUTEMK_CACHE_DIR")
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", str(tmp_path))
    assert runtime.kernel_cache_dir() == tmp_path / "cutemk_kernels"


_CHILD = """
import json, torch
import cutemk as mk
from cutemk import runtime
from cutemk.layers import mlp_graph, mlp_reference
torch.manual_seed(0)
g = mlp_graph(mk.sym("T", max=512), 256, 192, torch.bfloat16, 64, 64)
c = g.compile("cute", scheduler="static", poison_outputs=True)
x = torch.randn(37, 256, device="cuda").bfloat16()
wgu = (torch.randn(384, 256, device="cuda") / 16).bfloat16()
wd = (torch.randn(256, 192, device="cuda") / 14).bfloat16()
err = ((c(x, wgu, wd).float() - mlp_reference(x, wgu, wd)).norm()
       / mlp_reference(x, wgu, wd).norm()).item()
print("RESULT " + json.dumps([runtime.compile_count, runtime.cache_loads, err]))
"""


@pytest.mark.gpu
def test_a_fresh_process_launches_the_cached_kernel(tmp_path):
    env = dict(os.environ, CUTEMK_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False
        )
        line = [s for s in out.stdout.splitlines() if s.startswith("RESULT ")]
        assert out.returncode == 0 and line, out.stderr[-3000:]
        runs.append(json.loads(line[0][len("RESULT ") :]))
    (c1, l1, e1), (c2, l2, e2) = runs
    assert (c1, l1) == (1, 0) and (c2, l2) == (0, 1)
    assert e1 < 2e-2 and e2 < 2e-2


def test_key_covers_the_source_of_ops_defined_outside_cutemk(tmp_path, monkeypatch):
    """A user's op (and its bases) outside cutemk: its module's source is part of the key, so
    editing its device code never loads the old kernel; a class without a source file (defined
    interactively) makes the kernel uncacheable."""
    import importlib.util
    import types

    from cutemk.ops.add import AddTile

    mod_path = tmp_path / "my_ops.py"
    mod_path.write_text("from cutemk.ops.add import AddTile\nclass MyAdd(AddTile):\n    pass\n")
    spec_ = importlib.util.spec_from_file_location("my_ops_for_cache_test", mod_path)
    mod = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, "my_ops_for_cache_test", mod)
    spec_.loader.exec_module(mod)
    own = types.SimpleNamespace(ops=_spec().ops)
    users = types.SimpleNamespace(ops=(*_spec().ops, mod.MyAdd.__new__(mod.MyAdd)))
    assert runtime._outside_sources(own) == runtime._outside_sources(types.SimpleNamespace(ops=()))
    before = runtime._outside_sources(users)
    mod_path.write_text(mod_path.read_text() + "# the device code changed\n")
    assert runtime._outside_sources(users) != before
    nowhere = types.ModuleType("defined_nowhere")  # no __file__
    monkeypatch.setitem(sys.modules, "defined_nowhere", nowhere)
    loose = type("Loose", (AddTile,), {"__module__": "defined_nowhere"})
    assert runtime._outside_sources(types.SimpleNamespace(ops=(loose.__new__(loose),))) is None


def test_compile_many_compiles_in_worker_processes_into_the_cache(cache_dir):
    from cutemk.kernels import compile_many

    specs = [_spec(256), _spec(320), _spec(256)]  # a repeat is compiled once
    for s in specs:
        _forget(s)
    assert compile_many(specs, workers=2) == 2
    assert len(list(cache_dir.glob("megakernel-*.o"))) == 2
    assert compile_many(specs) == 0  # all on disk now
    compiled, loaded = runtime.compile_count, runtime.cache_loads
    for s in specs[:2]:
        runtime._compile(s)
    assert runtime.compile_count == compiled and runtime.cache_loads == loaded + 2


@pytest.mark.parametrize("script,why", [("exit 3", "failed"), ("sleep 30", "no result in 1 s")])
def test_compile_many_leaves_failed_or_stuck_workers_to_the_launch(
    cache_dir, tmp_path, monkeypatch, script, why
):
    from cutemk.kernels import compile_many

    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat > /dev/null\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    specs = [_spec(192), _spec(224)]
    for s in specs:
        _forget(s)
    with pytest.warns(UserWarning, match=why):
        assert compile_many(specs, timeout_s=1.0) == 0
    assert not list(cache_dir.glob("megakernel-*.o"))
