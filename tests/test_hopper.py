"""The Gluon forward for Hopper (templates/attention_fwd_hopper.py.jinja, maskc/runtime/hopper.py).

Triton's interpreter runs only Triton's language, so no CPU test can execute this kernel:
tests/gpu/test_gluon.py runs it against the float64 reference on an H100. Here the
files it is rendered into are compiled for sm_90 with this machine's Triton (its ptxas needs
no GPU): the template, the printer's hooks in Gluon and the kernel's shared memory are
checked for every mask and score form, hypothesis-drawn ones too; and the rule that picks
the kernel is checked on CPU problems.
"""
from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _inputs import qkv
from maskc import masks, scores
from maskc._slots import Slots
from maskc.codegen.render import KERNEL_NAMES, render
from maskc.codegen.source import KernelSource, merge
from maskc.runtime import hopper, plan
from maskc.testing import assert_close_to_reference, attention_reference, strategies
from maskc.trace.mods import as_mask_mod, as_score_mod

pytest.importorskip("triton.experimental.gluon")
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

SMEM_LIMIT = 232448  # bytes a Hopper block may have (227 KiB)


def _compile(mask, score, D: int, kind: str = "hfwd", with_dq: bool = True, map_q_tile: int = 64):
    """Render the Hopper forward (kind "hfwd", for a block map of `map_q_tile` rows) or dK/dV
    kernel ("hbwd", computing dQ too where `with_dq`) for `mask` and `score` and compile it for
    sm_90 at head dim D."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    mt = as_mask_mod(mask).traced if mask is not None else None
    st_ = as_score_mod(score).traced if score is not None else None
    source = KernelSource.of(kind, mt, st_, exact=False)
    rendered = render(source)
    # Triton reads a kernel's source from its file
    path = Path(tempfile.mkdtemp()) / f"{kind}_{source.digest(codegen_hash='test', maskc_version='test')}.py"
    path.write_text(rendered.text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = KERNEL_NAMES[kind][0]
    fn = getattr(module, name)
    if kind == "hfwd":
        config, registers, consumer_registers = hopper.forward_tiles(D, map_q_tile, score is not None)
    else:
        config, registers, consumer_registers = hopper.BACKWARD[D], hopper.MAX_REGISTERS, None

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], gl.bfloat16)
        return f"tensordesc<bf16[1, 1, {rows}, {D}],{layout!r}>"

    constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, EVEN_KV=False, EVEN=False,
                      POSITIVE_SCALE=True, STAGES=config.num_stages, BH_GROUP=2, SPARSE_Q_MULTIPLE=1,
                      SPARSE_KV_MULTIPLE=2, WITH_DQ=with_dq, CONSUMER_REGS=consumer_registers)
    # the copy boxes' rows: the forward's q and out are a consumer's 64 rows of the q tile; the
    # dK/dV kernel's k and v a consumer's half of the kv tile
    consumer = hopper.CONSUMER_ROWS
    rows = dict(Q=consumer, Out=consumer, K=config.block_n, V=config.block_n) if kind == "hfwd" \
        else dict(Q=config.block_m, DO=config.block_m, K=config.block_n // 2, V=config.block_n // 2)
    signature, constants = {}, {}
    tensors = {f"T{i}": t for i, t in enumerate(_captured(mt, st_))}
    for i, p in enumerate(rendered.parameters[name]):
        if p in rows:
            signature[p] = desc(rows[p])
        elif p == "DQ":  # dQ's float32 sum, which the copy engine adds each tile's dQ into
            layout = gl.NVMMASharedLayout.get_default_for([1, 1, config.block_m, D], gl.float32)
            signature[p] = f"tensordesc<fp32[1, 1, {config.block_m}, {D}],{layout!r}>" if with_dq else "constexpr"
            constants.update({} if with_dq else {(i,): None})
        elif p in ("DK", "DV"):
            signature[p] = "*bf16"
        elif p in ("Lse", "Delta"):
            signature[p] = "*fp32"
        elif p in ("FULL_OFFSETS", "FULL_RUNS", "PARTIAL_OFFSETS", "PARTIAL_RUNS"):
            signature[p] = "*i32"
        elif p in tensors:
            signature[p] = "*fp32" if tensors[p].dtype.is_floating_point else "*i64"
        elif p.startswith("p") and p[1:].isdigit():
            signature[p] = "fp32" if source.param_kinds[int(p[1:])] == "f" else "i32"
        elif p == "qk_scale":
            signature[p] = "fp32"
        elif p in constexprs:
            signature[p] = "constexpr"
            constants[(i,)] = constexprs[p]
        else:
            signature[p] = "i32"
    return triton.compile(GluonASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps, "maxnreg": registers})


def _captured(mask, score):
    return merge(mask, score)[2]


def _check(compiled):
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx  # the tensor cores' asynchronous path, not mma.sync
    assert "cp.async.bulk.tensor" in ptx  # the copy engine
    assert "setmaxnreg" in ptx  # warp roles with their own register budgets
    assert "st.local" not in ptx and "ld.local" not in ptx  # no spills to local memory
    assert compiled.metadata.shared <= SMEM_LIMIT


CASES = [
    ("no mask", None, None),
    ("causal", masks.causal, None),
    ("document", masks.document(torch.tensor([0] * 40 + [1] * 60)), None),
    ("ALiBi", masks.causal, scores.alibi(scores.alibi_slopes(4))),
    ("softcap", None, scores.softcap(20.0)),
    ("relative bias", masks.sliding_window(64), scores.relative_bias(torch.zeros(4, 255))),
]


def _lane(params, ids, keep):
    """Each compile takes 5-20 s on a CI core: the default lane compiles the cases named in
    `keep`, `-m slow` the rest."""
    return [pytest.param(*p, id=i, marks=() if i in keep else pytest.mark.slow) for p, i in zip(params, ids)]


# every form at D=128, two at D=64 (at D=64 causal runs three consumers, ALiBi two:
# hopper.forward_tiles); the default lane's ALiBi-64 prints a mask and a score mod
@pytest.mark.parametrize("name, mask, score, D", _lane(
    [(*c, 128) for c in CASES] + [(*c, 64) for c in CASES[1:4:2]],
    [f"{c[0]}-128" for c in CASES] + [f"{c[0]}-64" for c in CASES[1:4:2]], keep={"ALiBi-64"}))
def test_the_hopper_forward_compiles_for_sm90(name, mask, score, D):
    _check(_compile(mask, score, D))


@pytest.mark.slow
def test_the_d64_forward_takes_three_consumers_where_its_rows_fit():
    assert hopper.forward_tiles(64, 64, scored=False)[0].block_m == 192
    assert hopper.forward_tiles(64, 128, scored=False)[0] == hopper.CONFIG  # a caller's 128-row map
    assert hopper.forward_tiles(64, 64, scored=True)[0] == hopper.CONFIG  # ALiBi spilled and lost
    assert hopper.forward_tiles(128, 64, scored=False)[0] == hopper.CONFIG
    # the two-consumer kernel at D=64, which a caller's 128-row map keeps
    _check(_compile(masks.causal, None, 64, map_q_tile=128))
    # three consumers' 160 registers each: ptxas (Triton 3.9) spills 96 bytes
    assert _stack_bytes(_compile(None, None, 64)) <= 128


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_drawn_mods_compile_for_sm90(data):
    # the forward; the dK/dV kernel prints the same hooks (test below)
    mask = data.draw(strategies.masks(100, 90, H=2))
    score = data.draw(strategies.score_mods(100, 90, H=2))
    _check(_compile(mask, score, data.draw(st.sampled_from([64, 128]))))


RATES = torch.arange(1.0, 101.0) * 0.1


def rates_and_roots(b, h, q_idx, kv_idx):
    return (RATES[q_idx] / RATES[kv_idx] >= 1) | (torch.sqrt(RATES[kv_idx]) * 3 > q_idx)


@pytest.mark.parametrize("kind", [pytest.param("hfwd", marks=pytest.mark.slow), "hbwd"])
def test_the_prelude_s_correctly_rounded_helpers_compile_for_sm90(kind):
    # _div and _sqrt (a captured table's division, a root) print tl.math.div_rn and sqrt_rn,
    # which Gluon takes too; the kernel decides on floats, so it runs without FMA contraction
    # (KernelSource.fuse_multiply_add), which is a launch option, not text
    _check(_compile(rates_and_roots, None, 64, kind=kind))


# the dK/dV kernel: the mask, the score mod and its derivative in the transposed tile, at the
# head dim it runs at by default (64, computing dQ too) and the one MASKC_GLUON=always adds
# (128, without dQ: hopper.computes_dq); without dQ at 64 too (deterministic algorithms,
# gradients for captured tensors)
@pytest.mark.parametrize("name, mask, score, D, with_dq", _lane(
    [(*c, 64, True) for c in CASES[1:5]] + [(*CASES[5], 128, False), (*CASES[1], 64, False)],
    [f"{c[0]}-64" for c in CASES[1:5]] + [f"{CASES[5][0]}-128", "causal-64-without dQ"], keep={"causal-64"}))
def test_the_hopper_dkdv_kernel_compiles_for_sm90(name, mask, score, D, with_dq):
    _check(_compile(mask, score, D, kind="hbwd", with_dq=with_dq))


def _stack_bytes(compiled) -> int:
    """ptxas's stack frame (spilled registers) of a compiled kernel, read from its cubin."""
    import subprocess

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip(f"this Triton ships no cuobjdump at {cuobjdump} to read the cubin's stack frame with")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True,
                               check=True).stdout
    return int(usage.split("STACK:")[1].split()[0])


@pytest.mark.slow
def test_the_dkdv_kernels_descriptors_are_not_spilled():
    # At D=128 with dQ, K, V, P and dS views made before the tile loop had their wgmma
    # descriptors hoisted and spilled (ptxas: 480 bytes with Triton 3.9, 208-360 with 3.6), and
    # the reloads held up every product (benchmarks/NOTES.md, stall profile); made in the tile,
    # 64 bytes with 3.9, 0-112 with 3.6.
    assert _stack_bytes(_compile(None, None, 128, kind="hbwd", with_dq=True)) <= 128


def _problem(mask, score, L, D=64):
    q = torch.empty(1, 2, L, D)
    mask, score = as_mask_mod(mask) if mask else None, as_score_mod(score) if score else None
    return plan.problem_of(q, q, q, mask, score, 0.125, plan.traces_of(mask, score))


DOCUMENTS = torch.arange(4).repeat_interleave(2048)


# benchmarks/bench_kernel_choice.py's measurements (hopper.MIN_TILES_PER_ROW)
@pytest.mark.parametrize("mask, score, L, D, faster", [
    (None, None, 4096, 64, True),  # 32 tiles a row
    (masks.causal, None, 8192, 64, True),  # 32.5 tiles a row on average: a tie
    (masks.causal, None, 4096, 64, False),  # 16.5: the Triton kernel measured 1.2x faster
    (masks.causal, None, 4096, 128, True),  # 16.5: 1.14x
    (masks.causal, None, 2048, 128, False),  # 8.5, from 1 to 16 a row: 0.93x
    (masks.sliding_window(1024), None, 8192, 128, True),  # 8.4, rows of one length: 1.04-1.07x
    (masks.sliding_window(1024), None, 8192, 64, False),  # a loss at D=64 up to 24.8 tiles a row
    (masks.sliding_window(768), None, 8192, 128, False),  # 6.7: a tie
    (masks.document(DOCUMENTS, causal=True), None, 8192, 128, False),  # 8.5 a row, documents lost at 8.5-10.9
    (masks.document(torch.zeros(8192, dtype=torch.int64), causal=True), None, 8192, 128, True),
    # causal's rows, but the ids' loads: lost at D=64 where causal tied
    (masks.document(torch.zeros(8192, dtype=torch.int64), causal=True), None, 8192, 64, False),
    (masks.causal, scores.alibi(scores.alibi_slopes(2)), 8192, 64, True),  # a split score mod
    (masks.causal, scores.softcap(30.0), 8192, 64, False),  # tanh: the Triton kernel measured twice as fast
], ids=["no mask", "causal 8192", "causal 4096", "causal 4096 D=128", "causal 2048 D=128", "sliding D=128",
        "sliding D=64", "sliding 768 D=128", "documents D=128", "one document D=128", "one document D=64",
        "ALiBi", "softcap"])
def test_the_kernel_is_chosen_where_it_measured_faster(mask, score, L, D, faster):
    assert hopper._faster(_problem(mask, score, L, D)) is faster


@pytest.mark.parametrize("setting, D, forced, runs", [
    ("1", 64, False, True),  # measured faster than the Triton backward on all seven workloads
    ("1", 128, False, True),  # faster on causal, prefix-LM and softcap, within 3% on the other four
    ("always", 128, False, True),
    ("0", 64, False, False),
    ("0", 128, False, False),
    ("1", 64, True, False),  # backward tiles forced (tune.py): the Triton kernels'
])
def test_the_dkdv_kernel_runs_wherever_it_can_unless_told_not_to(monkeypatch, setting, D, forced, runs):
    from maskc.runtime.tiles import BackwardConfig, TileConfig, use_config
    monkeypatch.setattr(hopper, "_can_run", lambda problem: True)  # as on an H100 with Gluon
    monkeypatch.setenv("MASKC_GLUON", setting)
    problem = _problem(masks.causal, None, 256, D)
    forcing = BackwardConfig(TileConfig(32, 32, 4, 1), TileConfig(32, 32, 4, 1)) if forced else None
    with use_config(backward=forcing):
        assert hopper.runs_backward(problem) is runs


def test_the_dkdv_kernel_computes_dq_where_it_may(monkeypatch):
    # atomic additions, so not under deterministic algorithms; not where the dQ kernel sums a
    # captured tensor's gradient
    assert hopper.computes_dq(_problem(masks.causal, None, 256, 64))
    assert hopper.computes_dq(_problem(masks.causal, None, 256, 128))
    # kv lengths off its 128-row tiles too: the kernel zeroes dS past kv_len
    assert hopper.computes_dq(_problem(masks.causal, None, 300, 64))
    q = torch.empty(1, 2, 256, 64)
    mask, score = as_mask_mod(masks.causal), as_score_mod(scores.relative_bias(torch.zeros(2, 511), offset=255))
    learnable = plan.problem_of(q, q, q, mask, score, 0.125, plan.traces_of(mask, score), grad_slots=(0,))
    assert learnable.grad_tensors and not hopper.computes_dq(learnable)
    torch.use_deterministic_algorithms(True)
    try:
        assert not hopper.computes_dq(_problem(masks.causal, None, 256, 64))
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_dkdv_kernels_dq_sum_has_a_descriptor():
    q = torch.zeros(1, 2, 100, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 300, 64, dtype=torch.bfloat16)
    found = hopper.backward_descriptors(q, k, k, q, torch.zeros(q.shape), 64)
    assert [d.block_shape for d in found] == [[1, 1, 64, 64], [1, 1, 64, 64], [1, 1, 64, 64], [1, 1, 64, 64],
                                              [1, 1, 64, 64]]
    assert hopper.backward_descriptors(q, k, k, q, None, 64)[4] is None


def test_descriptors_follow_the_copy_engines_rules():
    q = torch.zeros(2, 4, 100, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 300, 128, dtype=torch.bfloat16)
    found = hopper.descriptors(q, k, k, q, hopper.CONFIG)
    assert [d.block_shape for d in found] == [[1, 1, 64, 128], [1, 1, 128, 128], [1, 1, 128, 128], [1, 1, 64, 128]]
    # q and out share one block and layout: the kernel writes out through q's buffer
    assert found[0].layout == found[3].layout
    # a [B, L, H, D] tensor seen as [B, H, L, D] is fine; a last dim that is not contiguous is not
    assert hopper.descriptors(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, q, hopper.CONFIG) is not None
    assert hopper.descriptors(q.transpose(2, 3), k, k, q, hopper.CONFIG) is None
    assert hopper.descriptors(q, k[:, :, :, 1:121], k, q, hopper.CONFIG) is None  # 2 bytes past 16-byte alignment


def test_a_failed_first_launch_warns_and_runs_the_triton_forward(monkeypatch):
    # a Triton whose Gluon API moved again, say: the call still answers, through the Triton kernel
    import maskc
    from maskc.runtime import launch

    def broken(problem):
        raise RuntimeError("async_copy_global_to_shared has been removed; call async_load instead")

    monkeypatch.setattr(hopper, "_failures", {})
    monkeypatch.setattr(hopper, "runs", lambda problem: "hfwd" not in hopper._failures)
    monkeypatch.setattr(hopper, "descriptors", lambda q, k, v, out, config: [q, k, v, out])
    monkeypatch.setattr(launch, "_hopper_plan", broken)
    plan.PLANS.clear()
    q, k, v = (torch.randn(1, 2, 100, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with pytest.warns(RuntimeWarning, match="Gluon forward for Hopper failed.*async_load.*MASKC_GLUON=0"):
        out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    assert_close_to_reference(out, attention_reference(q, k, v, masks.causal)[0])
    assert "RuntimeError" in hopper._failures["hfwd"]
    plan.PLANS.clear()


class _FakeGluonPlan:
    """Stands in for the Gluon forward's launch plan on the CPU: its compile is recorded and
    raises `error`, if any; a launch is recorded and writes the float64 reference."""

    def __init__(self, error=None):
        self.error, self.launched, self.warmed = error, 0, 0

    def warmup(self, q, k, v, out, lse):
        self.warmed += 1
        if self.error:
            raise self.error

    def __call__(self, q, k, v, out, lse):
        self.launched += 1
        want, want_lse = attention_reference(q, k, v, masks.causal)
        out.copy_(want)
        lse.copy_(want_lse)


def _gluon_everywhere(monkeypatch, fake):
    from maskc.runtime import launch
    monkeypatch.setattr(hopper, "_failures", {})
    monkeypatch.setattr(hopper, "runs", lambda problem: "hfwd" not in hopper._failures)
    monkeypatch.setattr(hopper, "descriptors", lambda q, k, v, out, config: [q, k, v, out])
    monkeypatch.setattr(launch, "_hopper_plan", lambda problem: fake)
    plan.PLANS.clear()


def test_a_gluon_launch_prepares_its_outputs_only_when_it_runs(monkeypatch):
    # the dK/dV kernel's dQ sum is zeroed right before the kernel adds into it, not on a call whose
    # Gluon compile failed (the Triton kernels answer that one)
    from maskc.runtime import launch
    monkeypatch.setattr(hopper, "_failures", {})
    events = []

    class Plan:
        def __init__(self, error=None):
            self.error = error

        def warmup(self):
            events.append("compile")
            if self.error is not None:
                raise self.error

        def __call__(self):
            events.append("launch")

    problem = _problem(masks.causal, None, 256)

    def call(gluon_plan):
        return launch._launch_gluon(problem, "hbwd+dq", lambda p: gluon_plan, (), lambda: events.append("prepare"))
    with pytest.warns(RuntimeWarning, match="dK/dV kernel with dQ for Hopper failed to compile"):
        assert not call(Plan(RuntimeError("ptxas fatal: out of registers")))
    assert events == ["compile"]
    events.clear()
    working = Plan()
    assert call(working) and call(working)
    assert events == ["compile", "prepare", "launch", "prepare", "launch"]


def test_a_failed_compile_warns_at_the_first_call_and_leaves_the_triton_forward(monkeypatch):
    import maskc
    fake = _FakeGluonPlan(error=RuntimeError("ptxas fatal: out of registers"))
    _gluon_everywhere(monkeypatch, fake)
    q, k, v = qkv(Lq=100)
    try:
        with pytest.warns(RuntimeWarning, match="Gluon forward for Hopper failed to compile.*out of registers"):
            out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
        assert_close_to_reference(out, attention_reference(q, k, v, masks.causal)[0])
        maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
        assert (fake.warmed, fake.launched) == (1, 0)
    finally:
        plan.PLANS.clear()


def test_a_kernel_that_does_not_fit_leaves_the_gluon_kernel_to_other_mods(monkeypatch):
    # shared memory or registers a mod's code adds: that mod runs the Triton forward, also once
    # its plan left the cache, and the next mod still takes the Gluon kernel (a version failure
    # would end it for all)
    import maskc
    from triton.runtime.errors import OutOfResources
    fake = _FakeGluonPlan(error=OutOfResources(294912, 232448, "shared memory"))
    rule = hopper.runs
    _gluon_everywhere(monkeypatch, fake)
    monkeypatch.setattr(hopper, "runs", rule)  # the module's own rule, which reads the problem's failure
    monkeypatch.setattr(hopper, "_can_run", lambda problem: True)
    monkeypatch.setattr(hopper, "_misfits", Slots(8))
    monkeypatch.setenv("MASKC_GLUON", "always")  # the Gluon kernel wherever it can run
    q, k, v = qkv(Lq=100)
    try:
        with pytest.warns(RuntimeWarning, match="did not fit this GPU.*head dim 16.*other mods keep the Gluon kernel"):
            out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
        assert_close_to_reference(out, attention_reference(q, k, v, masks.causal)[0])
        assert not hopper._failures
        maskc.compiled_attention(q, k, v, mask_mod=masks.causal)  # this problem: not tried again
        plan.PLANS.clear()
        maskc.compiled_attention(q[:, :, :90], k, v, mask_mod=masks.causal)  # nor planned anew, other length
        assert (fake.warmed, fake.launched) == (1, 0)
        fake.error = None
        maskc.compiled_attention(q, k, v, mask_mod=masks.sliding_window(8))  # another mod: tried
        assert (fake.warmed, fake.launched) == (2, 1)
    finally:
        plan.PLANS.clear()


@pytest.mark.parametrize("how", ["1", "always", "deterministic"])
def test_every_setting_compiles_before_the_first_call(monkeypatch, how):
    import maskc
    fake = _FakeGluonPlan()
    _gluon_everywhere(monkeypatch, fake)
    if how == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    else:
        monkeypatch.setenv("MASKC_GLUON", how)
    try:
        maskc.compiled_attention(*qkv(Lq=100), mask_mod=masks.causal)
        assert (fake.warmed, fake.launched) == (1, 1)
        maskc.compiled_attention(*qkv(Lq=100), mask_mod=masks.causal)
        assert (fake.warmed, fake.launched) == (1, 2)
    finally:
        plan.PLANS.clear()
