"""The direct launch (maskc/runtime/launch.py, LaunchPlan): a kernel Triton compiled is launched
again without Triton's entry point only while the per-call values specialise as they did; any
other value takes Triton's path. Triton's compiled kernel and the CUDA device are stand-ins
here, so this runs on the CPU; tests/gpu/test_attention.py runs the real one."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from maskc.runtime import launch
from maskc.runtime.launch import LaunchPlan


@pytest.fixture
def plan(monkeypatch):
    """A LaunchPlan of a kernel `k(X, n, BLOCK, Y, stride_y)` with X, Y and stride_y per call,
    whose launches land in `plan.calls`: ("triton", args) through Triton's entry point,
    ("direct", args, grid, stream) through the compiled kernel's launcher."""
    calls = []

    class Compiled:  # what Triton's fn[grid](...) returns
        def __getitem__(self, grid):
            return lambda *args, stream=None: calls.append(("direct", args, grid, stream))

    def entry_point(*args, **options):
        calls.append(("triton", args))
        return Compiled()

    device = [0]
    monkeypatch.delenv("MASKC_DIRECT_LAUNCH", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda d: 100 + d)))
    kernel = SimpleNamespace(parameters={"k": ("X", "n", "BLOCK", "Y", "stride_y")}, path=Path("k.py"), options={},
                             function=lambda interpret, name: {(4, 2): entry_point})
    made = LaunchPlan(kernel, "k", False, (4, 2), {"n": 7, "BLOCK": 64}, ("X", "Y", "stride_y"), {"num_warps": 4})
    made.calls, made.device = calls, device
    return made


def test_a_launch_goes_direct_while_its_values_specialise_as_they_did(plan):
    x, y = torch.zeros(8), torch.zeros(8, 2)
    plan(x, y, 1)  # Triton compiles, and the direct launcher is made for these values
    plan(torch.ones(8), y, 1)
    assert plan.calls[0][0] == "triton" and plan.calls[0][1][:3] == (x, 7, 64)
    kind, args, grid, stream = plan.calls[1]
    assert kind == "direct" and args[1:] == (7, 64, y, 1) and grid == (4, 2, 1) and stream == 100


@pytest.mark.parametrize("change", ["another int", "a bool for an int", "a tensor for an int", "an int for a tensor",
                                    "a misaligned tensor", "another dtype", "another device"])
def test_values_that_would_specialise_otherwise_take_tritons_path(plan, change):
    x, y = torch.zeros(8), torch.zeros(8, 2)
    plan(x, y, 1)
    values = {"another int": (x, y, 16),
              "a bool for an int": (x, y, True),  # True == 1, but Triton specialises a bool apart
              "a tensor for an int": (x, y, torch.tensor(1)),  # compares equal to 1
              "an int for a tensor": (x, 0, 1),
              "a misaligned tensor": (x[1:], y, 1),  # 4 bytes past the start: not 16-byte aligned
              "another dtype": (x.double(), y, 1),
              "another device": (x, y, 1)}[change]
    if change == "another device":
        plan.device[0] = 1
    plan(*values)
    assert [c[0] for c in plan.calls] == ["triton", "triton"]
    plan.device[0] = 0
    plan(x, y, 1)  # the direct launcher stays for the values it was made for
    assert plan.calls[-1][0] == "direct"


@pytest.mark.parametrize("first, then, direct", [(32, 4096, True), (24, 40, True), (17, 3, True), (32, 40, False),
                                                  (2, 1, False), (48, 2**31, False)],
                         ids=["both multiples of 16", "neither", "odd", "divisibility differs", "one",
                              "past int32"])
def test_another_int_goes_direct_where_triton_specialises_it_alike(plan, first, then, direct):
    """A cache that grows a token a step gives the decoding launch new strides every step: those
    Triton specialises alike (== 1, % 16, int32 or wider) launch directly, as the first did."""
    x, y = torch.zeros(8), torch.zeros(8, 2)
    plan(x, y, first)
    plan(x, y, then)
    assert plan.calls[-1][0] == ("direct" if direct else "triton")
