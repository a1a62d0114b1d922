"""Import a generated source file as a module, compiled for CUDA or interpreted for CPU.

Triton picks the interpreter when `@triton.jit` runs with TRITON_INTERPRET=1, so the
interpreted copy is imported with that variable set; both copies run the same file.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

_LOCK = threading.Lock()


def load(path: Path, *, interpret: bool):
    name = f"maskc_generated.{path.stem}{'_interp' if interpret else ''}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with _LOCK:
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            spec.loader.exec_module(module)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return module
