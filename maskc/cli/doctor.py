"""`maskc doctor`: what maskc runs on here, and whether it runs, in lines to paste into a bug report."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from maskc import masks
from maskc._version import __version__
from maskc.cli._common import size, table
from maskc.runtime import cache, descriptors, hopper
from maskc.runtime.api import compiled_attention
from maskc.settings import cache_dir, overridden
from maskc.testing.asserts import assert_close_to_reference
from maskc.testing.reference import attention_reference

# The copy engine (TMA) that tensor descriptors load through: Hopper (sm_90) and later.
COPY_ENGINE_MAJOR = 9


def add_doctor(commands, help: str) -> None:
    parser = commands.add_parser(
        "doctor", help=help,
        description="Report the versions maskc runs with, the GPU and its capability, which fast paths apply, the "
                    "cache directory and the settings in force; then run a tiny attention through Triton's "
                    "interpreter (and compiled, where there is a GPU) against the float64 reference. Exits 1 when "
                    "a check fails. Paste the output into bug reports.")
    parser.set_defaults(run=run, parser=parser)


def run(args) -> int:
    rows = [("maskc", f"{__version__} ({Path(__file__).resolve().parents[1]})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform()),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
            ("triton", triton.__version__)]
    rows += [(name, _version(name)) for name in ("sympy", "jinja2", "numpy", "matplotlib")]
    rows += _gpus()
    rows.append(("cache", _cache()))
    rows.append(("settings", ", ".join(f"{k}={v}" for k, v in overridden().items()) or "defaults (none set)"))
    print(table(rows), flush=True)
    checks = [("interpreter", torch.device("cpu"), torch.float32)]
    if torch.cuda.is_available():
        checks.append(("cuda kernel", torch.device("cuda"), torch.float16))
    failed = False
    for name, device, dtype in checks:
        verdict, ok = _check(device, dtype)
        failed |= not ok
        print(f"{name:<18}  {verdict}", flush=True)
    return 1 if failed else 0


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed" + (" (pictures need it: pip install 'maskc[plot]')" if name == "matplotlib" else "")


def _gpus() -> list[tuple[str, str]]:
    has_descriptors = descriptors.TensorDescriptor is not None
    if not torch.cuda.is_available():
        return [("gpu", "none: torch sees no CUDA device; CPU tensors run through Triton's interpreter")]
    rows = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        rows.append((f"gpu {i}", f"{p.name}, sm_{p.major}{p.minor}, {size(p.total_memory)}"))
    major = torch.cuda.get_device_capability(0)[0]
    if not has_descriptors:
        tma = f"no: Triton {triton.__version__} has no host-side tensor descriptors (3.4 and later do)"
    elif major < COPY_ENGINE_MAJOR:
        tma = f"no: sm_{major}x has no copy engine (Hopper, sm_90, and later do); loads use pointers"
    else:
        tma = "yes: the forward and dQ load q, k, v through the copy engine on large enough problems"
    rows.append(("tensor descriptors", tma))
    gluon = major == 9 and hopper.available()
    rows.append(("hopper kernels", "yes: the Gluon forward and dK/dV kernels run where they measured faster "
                 "(MASKC_GLUON)" if gluon else "no: they need an sm_90 GPU and a Triton with Gluon's Hopper module"))
    return rows


def _cache() -> str:
    home = cache_dir()
    try:
        home.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=home, suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
        state = "writable"
    except OSError as error:
        state = f"NOT writable ({error}): new kernels go to a temporary directory, deleted at exit"
    found = cache.entries(home)
    return f"{home}, {state}, {len(found)} kernels ({size(sum(e.size for e in found))})"


def _check(device: torch.device, dtype: torch.dtype) -> tuple[str, bool]:
    """Run a tiny causal attention on `device` against the float64 reference: (verdict, passed)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(dtype) for _ in range(3))
    start = time.perf_counter()
    try:
        out = compiled_attention(*(t.to(device) for t in (q, k, v)), mask_mod=masks.causal)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        ref, _ = attention_reference(q.double(), k.double(), v.double(), mask_mod=masks.causal)
        assert_close_to_reference(out.cpu(), ref, dtype=dtype)
    except Exception as error:  # the report is the point: say what failed, and go on to the next check
        return f"FAILED: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", False
    what = "interpreted" if device.type == "cpu" else "compiled"
    verdict = f"ok: causal attention {what} on {device.type}, {dtype}, matches the float64 reference"
    return f"{verdict} ({elapsed:.1f} s)", True


__all__ = ["add_doctor", "run"]
