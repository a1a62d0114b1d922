"""The first call runs the kernel every later call runs (maskc/runtime/hopper.py): a causal forward
where the default rule picks the Gluon kernel on Hopper (bf16, B=1, H=2, L=4096, D=128: 16.5 kv
tiles a row), each check in a fresh process with caches of its own.

- A new process with empty caches: the first and the 50th call run the same kernels and give
  the same bits.
- A new process on those caches: the first call loads every kernel from Triton's and maskc's
  disk caches (Gluon's too) and answers within 0.5 s, with the same bits.
- maskc.warmup, then the first call: Triton compiles nothing more.

The kernels that ran come from torch's profiler (CUDA kernel names), the compiles from Triton's
jit_cache_hook, which Triton calls before it compiles or loads a kernel a process has not run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import maskc

SECONDS_WARM = 0.5  # the first call of a new process on warm caches (issue 41's target)

_CHILD = r"""
import json, sys, time
import torch
import triton
from torch.profiler import ProfilerActivity, profile

import maskc

mode, folder = sys.argv[1], sys.argv[2]
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 4096, 128, generator=generator).to("cuda", torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()


def call():
    out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
    torch.cuda.synchronize()
    return out


def profiled():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = call()
    return out, sorted({e.name for e in prof.events() if e.name.startswith("attention")})


report = {}
compiles = []
if mode == "warmup":
    report["warmed"] = sorted(maskc.warmup(q, k, v, maskc.masks.causal).kernels)
triton.knobs.runtime.jit_cache_hook = lambda **kwargs: compiles.append(kwargs["repr"])
if mode == "cold":
    first, report["first"] = profiled()
else:
    start = time.perf_counter()
    first = call()
    report["first_seconds"] = time.perf_counter() - start
report["compiled_by_first_call"] = list(compiles)
for _ in range(48):
    call()
fiftieth, report["fiftieth"] = profiled()
report["fiftieth_equal"] = torch.equal(first, fiftieth)
torch.save(first.cpu(), f"{folder}/{mode}.pt")
print(json.dumps(report))
"""


def _run(mode: str, caches: Path, folder: Path) -> dict:
    """The child's report, run in a new process on the kernel caches under `caches`."""
    env = {**os.environ, "MASKC_CACHE_DIR": str(caches / "maskc"), "TRITON_CACHE_DIR": str(caches / "triton")}
    for knob in ("MASKC_GLUON", "MASKC_AUTOTUNE", "MASKC_DEBUG", "TRITON_ALWAYS_COMPILE"):
        env.pop(knob, None)
    # the maskc this test imported, wherever the child starts
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(maskc.__file__).parent.parent),
                                                      env.get("PYTHONPATH"))))
    result = subprocess.run([sys.executable, "-c", _CHILD, mode, str(folder)], env=env, cwd=folder,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _gluon_forward_expected() -> bool:
    from maskc.runtime import hopper
    return torch.cuda.get_device_capability() == (9, 0) and hopper._gluon() is not None


def test_first_call_runs_the_later_calls_kernel_then_a_new_process_loads_it(tmp_path):
    cold = _run("cold", tmp_path / "caches", tmp_path)
    assert cold["compiled_by_first_call"], "Triton's jit_cache_hook saw no compile in an empty cache"
    assert cold["first"] == cold["fiftieth"], f"the first call ran {cold['first']}, the 50th {cold['fiftieth']}"
    assert cold["fiftieth_equal"], "the first and the 50th call's outputs differ"
    if _gluon_forward_expected():
        assert cold["first"] == ["attention_fwd_hopper"], cold["first"]
    warm = _run("warm", tmp_path / "caches", tmp_path)
    assert warm["fiftieth"] == cold["first"]
    assert warm["fiftieth_equal"]
    assert torch.equal(torch.load(tmp_path / "warm.pt"), torch.load(tmp_path / "cold.pt")), \
        "a new process's first call differs from the first process's"
    assert warm["first_seconds"] <= SECONDS_WARM, \
        f"the first call of a new process on warm caches took {warm['first_seconds']:.2f} s"


def test_after_warmup_the_first_call_compiles_nothing(tmp_path):
    warmed = _run("warmup", tmp_path / "caches", tmp_path)
    assert warmed["compiled_by_first_call"] == [], warmed["compiled_by_first_call"]
    assert [name.split(" of ")[0] for name in warmed["warmed"]] == warmed["fiftieth"]
    assert warmed["fiftieth_equal"]
    if _gluon_forward_expected():
        assert warmed["fiftieth"] == ["attention_fwd_hopper"], warmed["fiftieth"]
