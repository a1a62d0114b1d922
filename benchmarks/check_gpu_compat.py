"""GPU check of the compatibility cases: every mod of tests/test_compat.py (attention-gym's
masks and mods as the package ships them, FlexAttention's own test mods) run COMPILED on
CUDA, forward and backward, against the float64 reference.

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_compat.py          # needs attn-gym importable
    bash benchmarks/run_gpu.sh benchmarks/check_gpu_compat.py 2/8      # the second of eight shards
    bash benchmarks/run_gpu.sh benchmarks/check_gpu_compat.py --gluon  # FlexAttention's mods, Gluon kernels
    bash benchmarks/run_gpu.sh benchmarks/check_gpu_compat.py --projects [--bf16] [--only REGEX]  # transformers', projects'

Compiling each case's kernels takes seconds, so shards can run as parallel processes.

--projects runs the mods of tests/test_compat_transformers_masks.py (transformers' own mask and
score functions; needs transformers) and tests/test_compat_projects.py (torchtitan, torchtune,
vLLM, Lingua, gpt-fast) the same way, at their test lengths.

--gluon runs FlexAttention's test mods (tests/compat_mods.py) through the Gluon Hopper kernels
(MASKC_GLUON=always; they need at least 64 queries and 128 keys): each case at GLUON_SCALE
times its lengths, with compat_mods' S scaled alike before the mods are built, bfloat16, D=64
(the dK/dV kernel computing dQ). The reference runs on the CPU, on a second build of the mods
there: a mod whose captured sizes do not follow S fails there with an index error, which is
counted apart, not as maskc's failure. attention-gym's mods: check_gpu_gym_hopper.py.

The CPU suite runs the same generated source through Triton's interpreter; compiled code can
differ (integer widths, library functions such as erf, constexpr folding), so this runs each
case at float32 and bfloat16 with ragged lengths. Captured tensors are moved to the GPU
after a case is built. Prints one line per case
that fails or is refused, and a count; exits non-zero if any case fails.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import zlib
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
    the functions it captures) moved to the GPU, in place but for a partial, which is rebuilt:
    the cases are built on the CPU, as the test suite builds them, and maskc requires captured
    tensors beside q."""
    seen = set() if seen is None else seen
    if fn is None or id(fn) in seen:
        return fn
    seen.add(id(fn))
    fn = getattr(fn, "fn", fn)
    if isinstance(fn, functools.partial):  # a new partial: its arguments cannot be replaced in place
        return functools.partial(to_cuda(fn.func, seen), *(moved(a, seen) for a in fn.args),
                                 **{k: moved(a, seen) for k, a in fn.keywords.items()})
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
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and id(value) not in seen:
        seen.add(id(value))  # an object the mod reads attributes of (vLLM's metadata): its tensors, in place
        for name, attribute in vars(value).items():
            if isinstance(attribute, torch.Tensor):
                setattr(value, name, attribute.cuda())
        return value
    if callable(value) and not isinstance(value, type):
        to_cuda(value, seen)
    return value


def run(case, dtype) -> str | None:
    return run_mods(*compat.mods(case), case.B, case.q_len, case.kv_len, dtype)


def run_mods(mask_mod, score_mod, B, q_len, kv_len, dtype, reference_score=None) -> str | None:
    """The mods compiled on CUDA against the float64 reference (which takes `reference_score`
    for the score_mod where given)."""
    mask_mod, score_mod, reference_score = (to_cuda(m) for m in (mask_mod, score_mod, reference_score))
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (B, compat.HEADS, q_len, 64)
    shape_kv = (B, compat.HEADS, kv_len, 64)
    q, k, v = (torch.randn(s, generator=g, device="cuda").to(dtype).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    do = torch.randn(shape_q, generator=g, device="cuda").to(dtype)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, mask_mod=mask_mod, score_mod=reference_score or score_mod)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    return compared((out, lse, *grads), (ref, ref_lse, *ref_grads), dtype)


def project_runs():
    """(id, runner of one dtype) of every project and transformers case."""
    import test_compat_projects as projects
    runs = [(c.id, functools.partial(lambda c, dtype: run_mods(c.build(), None, c.B, c.q_len, c.kv_len, dtype), c))
            for c in projects.MASKS]
    try:
        import test_compat_transformers_masks as hf
    except Exception as e:  # noqa: BLE001 - transformers absent or another version: say so, run the rest
        print(f"transformers cases not run: {type(e).__name__}: {str(e)[:120]}")
        return runs

    def run_hf(c, dtype):
        b = hf.built(c)
        reference = hf._as_the_kernels_read(b.score_mod) if c.padded_rows else None
        return run_mods(b.mask_mod, b.score_mod, hf.BATCH, b.q_len, b.kv_len, dtype, reference)
    return runs + [(c.id, functools.partial(run_hf, c)) for c in hf.CASES]


def main_projects(dtypes, only: str | None) -> None:
    import re

    import pytest
    failures = 0
    cases = [(i, r) for i, r in project_runs() if only is None or re.search(only, i)]
    for case_id, runner in cases:
        for dtype in dtypes:
            start = time.perf_counter()
            try:
                problem = runner(dtype=dtype)
            except pytest.skip.Exception as e:  # a model this transformers does not ship
                print(f"not run  {case_id:<48} {str(e)[:120]}")
                break
            except Exception as e:  # noqa: BLE001 - report every case, then fail the run
                problem = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"{'FAIL' if problem else 'ok':<8} {case_id:<48} {str(dtype)[6:]:<9} "
                  f"{problem or f'{time.perf_counter() - start:.1f} s'}", flush=True)
            failures += bool(problem)
    print(f"projects: {failures} failures of {len(cases)} cases × {len(dtypes)} dtypes")
    sys.exit(1 if failures else 0)


def compared(got, want, dtype) -> str | None:
    """What of (out, lse, dq, dk, dv) is off the reference's, or None."""
    (out, lse, *grads), (ref, ref_lse, *ref_grads) = got, want
    errors = {"out": close(out, ref, dtype)}
    errors.update({n: close(g_, r, dtype) for n, g_, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    finite = ~torch.isneginf(ref_lse)
    if not torch.equal(torch.isneginf(lse), ~finite):
        return "lse is -inf on other rows than the reference's"
    errors["lse"] = close(lse[finite], ref_lse[finite], dtype)
    return ", ".join(f"{n} {e:.1e}" for n, e in errors.items() if e > TOLERANCE[dtype]) or None


GLUON_SCALE = 8  # 40 × 56 queries and keys become 320 × 448 (ragged against 128-key tiles)


class NoReference(Exception):
    """The float64 reference could not run the mod at the scaled lengths."""


def built(case, device):
    """A fresh build of the case's (mask_mod, score_mod), with its own seed, its captured
    tensors on `device`."""
    with torch.random.fork_rng():
        torch.manual_seed(zlib.crc32(case.id.encode()))
        mods = case.build()
    return tuple(to_cuda(m) for m in mods) if device == "cuda" else mods


def run_gluon(case) -> str | None:
    from maskc.runtime import plan as plans
    Lq, Lkv = case.q_len * GLUON_SCALE, case.kv_len * GLUON_SCALE
    g = torch.Generator().manual_seed(0)
    # values bf16 can hold: a mod that compares scores with a threshold (padded_dense_causal) sees
    # the kernel's scores on the reference's side of it
    q64, k64, v64 = (torch.randn(case.B, compat.HEADS, n, 64, generator=g).to(torch.bfloat16).double().requires_grad_()
                     for n in (Lq, Lkv, Lkv))
    do = torch.randn(case.B, compat.HEADS, Lq, 64, generator=g, dtype=torch.float64)
    mask_mod, score_mod = built(case, "cpu")
    try:
        ref, ref_lse = attention_reference(q64, k64, v64, mask_mod=mask_mod, score_mod=score_mod)
    except (IndexError, RuntimeError) as e:
        raise NoReference(f"{type(e).__name__}: {str(e)[:120]}") from e
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do)
    mask_mod, score_mod = built(case, "cuda")
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
    plans.PLANS.clear()
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do.to("cuda", torch.bfloat16))
    ran = {key for p in plans.PLANS.values() for key in p.launches if key in ("hfwd", "hbwd", "hbwd+dq")}
    # compared beside the reference, on the CPU
    bad = compared([t.cpu() for t in (out, lse, *grads)], (ref, ref_lse, *ref_grads), torch.bfloat16)
    # dQ from the dK/dV kernel unless a captured tensor needs a gradient (hopper.computes_dq)
    if "hfwd" not in ran or not ran & {"hbwd", "hbwd+dq"}:
        return bad or f"the Gluon kernels did not both run (ran: {sorted(ran)})"
    return bad


def main():
    if "--projects" in sys.argv:  # --bf16: that dtype only (each case compiles its kernels: ~4 s a dtype)
        only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
        return main_projects([torch.bfloat16] if "--bf16" in sys.argv else list(TOLERANCE), only)
    args = [a for a in sys.argv[1:] if a != "--gluon"]
    shard, shards = map(int, args[0].split("/")) if args else (1, 1)
    gluon = "--gluon" in sys.argv
    if gluon:
        os.environ["MASKC_GLUON"] = "always"
        compat.fx.S *= GLUON_SCALE  # the mods read it when they are built
        compat.fx.seq_length = compat.fx.S  # a copy of S that the learnable-bias mods read
        runs = [(run_gluon, "bfloat16")]
    else:
        runs = [(functools.partial(run, dtype=dtype), str(dtype)[6:]) for dtype in TOLERANCE]
    cases = (compat.FLEX_CASES if gluon else compat.CASES)[shard - 1::shards]
    failures = refused = unbuildable = 0
    for case in cases:
        for runner, dtype in runs:
            try:
                problem = runner(case)
            except maskc.MaskTraceError as e:
                refused += 1
                print(f"refused  {case.id:<48} {str(e)[:110]}")
                break
            except NoReference as e:
                unbuildable += 1
                print(f"no ref   {case.id:<48} {e}")
                break
            except Exception as e:  # noqa: BLE001 - report every case, then fail the run
                problem = f"{type(e).__name__}: {str(e)[:200]}"
            if problem:
                failures += 1
                print(f"FAIL     {case.id:<48} {dtype:<9} {problem}")
    scaled = f", {unbuildable} whose reference could not run at {GLUON_SCALE}× length" if gluon else ""
    print(f"{'gluon ' if gluon else ''}shard {shard}/{shards}: {failures} failures, {refused} cases refused by the "
          f"tracer{scaled}, of {len(cases)} cases × {len(runs)} dtypes")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
