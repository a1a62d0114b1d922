"""The GPU lane: maskc's kernels compiled on CUDA against the float64 reference, each kernel family
and entry point (Triton-language and Gluon kernels, decoding, paged decoding, CUDA-graph replay,
captured-tensor gradients, the integrations, code we did not write).

    bash benchmarks/run_gpu.sh -m pytest tests/gpu -q              # on a GPU machine: the lane's sample
    bash benchmarks/run_gpu.sh -m pytest tests/gpu -q -m slow      # the rest of each sweep (hours)

Every test here is marked `gpu` and skipped where torch.cuda.is_available() is False, so the CPU
suite collects them and skips them at once. The CPU suite runs the same generated kernels
through Triton's interpreter; compiled code can differ (integer widths, library functions,
constexpr folding, the copy engine's loads), and the Gluon kernels run nowhere else.

Each case compiles its kernels (seconds), so the lane runs a fixed sample of each sweep and marks
the rest `slow`, which the suite's default options deselect (pyproject.toml registers both
markers) and `-m slow` runs. Drawn cases come from maskc.testing.strategies with
hypothesis derandomized (the same cases every run) and no shrinking. The header names the maskc
that runs: benchmarks/run_gpu.sh installs it into /tmp/maskc_site, and where a PYTHONPATH entry
holds a maskc, the lane refuses to run any other (a source tree on sys.path would shadow it).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False); run: bash benchmarks/run_gpu.sh -m pytest tests/gpu"


def pytest_configure(config):
    installed = _installed_maskc()
    if installed is not None:
        import maskc
        imported = Path(maskc.__file__).resolve().parent
        if imported != installed.resolve():
            raise pytest.UsageError(
                f"maskc was imported from {imported}, not from {installed} on PYTHONPATH: the working directory "
                f"shadows the installed copy; run through `bash benchmarks/run_gpu.sh -m pytest ...` "
                f"(PYTHONSAFEPATH=1) or from another directory")


def _installed_maskc() -> Path | None:
    """The maskc package in the first PYTHONPATH entry that holds one (run_gpu.sh's install), or None."""
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if (Path(entry) / "maskc" / "__init__.py").is_file():
            return Path(entry) / "maskc"
    return None


def pytest_report_header(config):
    import triton

    import maskc
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device: tests/gpu is skipped"
    return [f"maskc {maskc.__version__} from {Path(maskc.__file__).parent}",
            f"torch {torch.__version__}, triton {triton.__version__}, {device}"]


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture
def gluon_kernels(monkeypatch):
    """MASKC_GLUON=always: the Gluon kernels wherever they can run. Skips where they cannot (no
    Hopper GPU, no Gluon in this Triton). A Gluon failure ends that kernel for the process
    (runtime/hopper.py); it is forgotten after the test, so that later tests try it again."""
    from maskc.runtime import hopper
    if torch.cuda.get_device_capability() != (9, 0) or hopper._gluon() is None:
        pytest.skip("the Gluon kernels run on Hopper GPUs (compute capability 9.0) with Triton's Gluon")
    monkeypatch.setenv("MASKC_GLUON", "always")
    yield
    hopper._failures.clear()


@pytest.fixture
def triton_kernels(monkeypatch):
    """MASKC_GLUON=0: the Triton-language kernels only."""
    monkeypatch.setenv("MASKC_GLUON", "0")
