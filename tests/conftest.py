"""GPU tests (``@pytest.mark.gpu``) skip cleanly on machines without CUDA."""

import os

# CuTe DSL reads the target arch once, at import: pin it before any test imports cutlass, so
# CPU-only machines compile for the H200 (sm_90a) rather than the library default.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        ngpu = torch.cuda.device_count()
        for item in items:
            if "multigpu" in item.keywords and ngpu < 2:
                item.add_marker(pytest.mark.skip(reason=f"needs >= 2 GPUs, have {ngpu}"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")


@pytest.fixture
def benchmark_script(monkeypatch):
    """``benchmark_script(name)``: ``benchmarks/<name>.py`` loaded as a module (registered in
    ``sys.modules``, the benchmarks folder on ``sys.path`` as when the script runs), for tests
    of what a benchmark times against."""
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(_BENCHMARKS)

    def load(name: str):
        spec = importlib.util.spec_from_file_location(
            f"benchmark_{name}", os.path.join(_BENCHMARKS, f"{name}.py")
        )
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mod)
        spec.loader.exec_module(mod)
        return mod

    return load


_PTXAS: dict[str, str] = {}


def _ptxas(path) -> str:
    """``ptxas -arch=sm_90a -v``'s report of the kernel in ``path`` (once a file); skips the
    test where ptxas is not installed."""
    import shutil
    import subprocess

    key = str(path)
    if key not in _PTXAS:
        if shutil.which("ptxas") is None:
            pytest.skip("ptxas is not installed")
        _PTXAS[key] = subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", key, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    return _PTXAS[key]


@pytest.fixture
def spill_stores():
    """``spill_stores(ptx_path)``: the spill-store bytes ``ptxas -v`` reports for the kernel
    (the megakernel's threads have 168 registers: a body that needs more spills to local
    memory, silently and slowly); the test skips where ptxas is not installed."""
    import re

    def run(path) -> int:
        return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", _ptxas(path)))

    return run


@pytest.fixture
def wgmma_serialized():
    """``wgmma_serialized(ptx_path)``: whether ptxas serialized the kernel's wgmma, which
    costs every tensor-core tile of the kernel its overlap. Its notes C7514 / C7515 (a
    non-wgmma instruction reads or defines an accumulator register of a wgmma in flight, e.g.
    an accumulator's update under a branch) and C7520 (a ``wgmma.fence`` it had to add on a
    divergent path, e.g. before a wgmma under a branch) all say "wgmma.mma_async instructions
    are serialized"."""

    def run(path) -> bool:
        return "wgmma.mma_async instructions are serialized" in _ptxas(path)

    return run
