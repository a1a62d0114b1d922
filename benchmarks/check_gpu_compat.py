"""GPU check of the compatibility cases: every mod of tests/test_compat.py (attention-gym's
masks and mods as the package ships them, FlexAttention's own test mods) run COMPILED on
CUDA, forward and backward, against the float64 reference.

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_compat.py          # needs attn-gym importable
    bash benchmarks/run_gpu.sh benchmarks/check_gpu_compat.py 2/8      # the second of eight shards

Compiling each case's kernels takes seconds, so shards can run as parallel processes.

The CPU suite runs the same generated source through Triton's interpreter; compiled code can
differ (integer widths, library functions such as erf, constexpr folding), so this runs each
case at float32 and bfloat16 with ragged lengths. Captured tensors are moved to the GPU
after a case is built. Prints one line per case
that fails or is refused, and a count; exits non-zero if any case fails.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import maskc  # noqa: E402
import test_compat as compat  # noqa: E402
from maskc.testing import attention_reference  # noqa: E402

# bf16 keeps 8 bits of mantissa: its inputs are rounded before both computations, so the
# remaining difference is the kernel's bf16 P·V product and output rounding.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def close(got, want, dtype) -> float:
    """Largest error relative to the largest magnitude; NaN counts as infinite."""
    got, want = got.detach().double(), want.detach().double()
    if not want.numel():
        return 0.0
    if torch.isnan(got).any():
        return float("inf")
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1.0)


def to_cuda(fn, seen=None):
    """`fn` with every tensor it captures (closure cells, globals, partial arguments, through
    the functions it captures) moved to the GPU in place: the cases are built on the CPU, as
    the test suite builds them, and maskc requires captured tensors beside q."""
    seen = set() if seen is None else seen
    if fn is None or id(fn) in seen:
        return fn
    seen.add(id(fn))
    fn = getattr(fn, "fn", fn)
    if isinstance(fn, functools.partial):
        to_cuda(fn.func, seen)
        for a in (*fn.args, *fn.keywords.values()):
            to_cuda(a, seen) if callable(a) else None
        return fn
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        cell.cell_contents = moved(value, seen)
    for name in code.co_names:
        if name in fn.__globals__:
            fn.__globals__[name] = moved(fn.__globals__[name], seen)
    return fn


def moved(value, seen):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, seen) for v in value)
    if callable(value) and not isinstance(value, type):
        to_cuda(value, seen)
    return value


def run(case, dtype) -> str | None:
    mask_mod, score_mod = (to_cuda(m) for m in compat.mods(case))
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (case.B, compat.HEADS, case.q_len, 64)
    shape_kv = (case.B, compat.HEADS, case.kv_len, 64)
    q, k, v = (torch.randn(s, generator=g, device="cuda").to(dtype).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    do = torch.randn(shape_q, generator=g, device="cuda").to(dtype)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, mask_mod=mask_mod, score_mod=score_mod)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    errors = {"out": close(out, ref, dtype)}
    errors.update({n: close(g_, r, dtype) for n, g_, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    finite = ~torch.isneginf(ref_lse)
    if not torch.equal(torch.isneginf(lse), ~finite):
        return "lse is -inf on other rows than the reference's"
    errors["lse"] = close(lse[finite], ref_lse[finite], dtype)
    bad = {n: e for n, e in errors.items() if e > TOLERANCE[dtype]}
    return ", ".join(f"{n} {e:.1e}" for n, e in bad.items()) or None


def main():
    shard, shards = map(int, sys.argv[1].split("/")) if len(sys.argv) > 1 else (1, 1)
    cases = compat.CASES[shard - 1::shards]
    failures = refused = 0
    for case in cases:
        for dtype in TOLERANCE:
            try:
                problem = run(case, dtype)
            except maskc.MaskTraceError as e:
                refused += 1
                print(f"refused  {case.id:<48} {str(e)[:110]}")
                break
            except Exception as e:  # noqa: BLE001 - report every case, then fail the run
                problem = f"{type(e).__name__}: {str(e)[:200]}"
            if problem:
                failures += 1
                print(f"FAIL     {case.id:<48} {str(dtype)[6:]:<9} {problem}")
    print(f"shard {shard}/{shards}: {failures} failures, {refused} cases refused by the tracer, of "
          f"{len(cases)} cases × {len(TOLERANCE)} dtypes")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
