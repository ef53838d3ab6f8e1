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
