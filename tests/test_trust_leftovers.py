"""Writes torch does not version, random numbers outside torch, deep nests of torch.where: each
a way for a trace or a cached plan to describe something other than what runs."""
from __future__ import annotations

import random
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

import maskc
import maskc.distributed as md
from maskc.codegen.printer import TritonPrinter
from maskc.errors import MaskTraceError
from maskc.testing import assert_close_to_reference, attention_reference
from maskc.trace import dag
from _inputs import qkv


# -- `.data =` keeps a tensor's version and changes its storage ----------------------------------
@pytest.fixture
def one_rank():
    """A gloo group of this process alone: plan() and attention() without spawning."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_distributed_plan_sees_its_documents_reassigned(one_rank):
    ids = torch.zeros(64, dtype=torch.long)
    plan = md.plan(maskc.masks.document(ids), 64, block_size=16)
    q = torch.randn(1, 2, 64, 16)
    new = torch.zeros(64, dtype=torch.long)
    new[40:] = 1
    ids.data = new  # the same tensor and version, other values: the plan would skip pairs the mask now keeps
    with pytest.raises(ValueError, match="changed since this plan was made"):
        md.attention(q, q, q, plan)


def test_a_captured_view_keeps_its_values_when_its_base_is_reassigned():
    # torch gives `table.data = new` to the base alone: the view keeps the old storage and its
    # values, so the map and kernel built from the view stay right without a new plan
    table = torch.zeros(2, 64, dtype=torch.long)
    table[0, 32:] = 1
    ids = table[0]
    mask = maskc.masks.document(ids)
    q, k, v = qkv(Lq=64)
    first = maskc.compiled_attention(q, k, v, mask_mod=mask)
    new = torch.zeros(2, 64, dtype=torch.long)
    new[0, 16:] = 1
    table.data = new
    assert ids.tolist() == [0] * 32 + [1] * 32
    out = maskc.compiled_attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out, attention_reference(q, k, v, mask)[0].float(), atol=2e-5, rtol=2e-5)
    assert torch.equal(out, first)


# -- random numbers outside torch ----------------------------------------------------------------
_RNG = np.random.default_rng(0)
_PY_RNG = random.Random(0)
_randint = random.randint  # as `from random import randint` binds it


def _random_random(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= random.random() * 10


def _random_randint(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= random.randint(0, 5)


def _imported_randint(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= _randint(0, 5)


def _numpy_randint(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= np.random.randint(0, 5)


def _numpy_rand(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= np.random.rand() * 5


def _generator(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= _RNG.integers(0, 5)


def _python_generator(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= _PY_RNG.randint(0, 5)


def _new_generator(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= np.random.default_rng().integers(0, 5)


class _Jitter:
    def __init__(self):
        self.rng = np.random.default_rng(1)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.rng.standard_normal()


@pytest.mark.parametrize("mod, kind, name", [
    (_random_random, "mask_mod", "random.random"),
    (_random_randint, "mask_mod", "random.randint"),
    (_imported_randint, "mask_mod", "_randint"),
    (_numpy_randint, "mask_mod", "np.random.randint"),
    (_numpy_rand, "mask_mod", "np.random.rand"),
    (_generator, "mask_mod", "_RNG.integers"),
    (_python_generator, "mask_mod", "_PY_RNG.randint"),
    (_new_generator, "mask_mod", "np.random.default_rng"),
    (_Jitter(), "score_mod", "rng.standard_normal"),
], ids=lambda x: x if isinstance(x, str) and "." in x else None)
def test_random_numbers_outside_torch_are_refused(mod, kind, name):
    # each ran once, at trace time, and its one draw served every pair and every call
    with pytest.raises(MaskTraceError, match=rf"{kind} '\S+' calls {name}, which draws random numbers.*"
                                             rf"draw the random values outside the mod"):
        (maskc.mask_mod if kind == "mask_mod" else maskc.score_mod)(mod)


def test_numpy_without_its_random_numbers_still_traces():
    def wide(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= int(np.ceil(np.pi)) + np.int64(2)

    traced = maskc.mask_mod(wide).traced
    assert traced.signature == maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 6).traced.signature


# -- a deep nest of torch.where renders in time linear in its depth ------------------------------
def _nested(depth):
    def nested(b, h, q_idx, kv_idx):
        m = q_idx >= kv_idx
        for i in range(depth):
            m = torch.where(q_idx - kv_idx > i, m & (kv_idx >= i), m | (q_idx == i))
        return m
    return nested


def test_a_deep_nest_of_where_renders_in_linear_time(monkeypatch):
    expr = maskc.mask_mod(_nested(60)).traced.expr
    nodes = len(dag.postorder(expr))
    walked = []
    postorder = dag.postorder

    def counting(e):
        found = postorder(e)
        walked.append(len(found))
        return found
    monkeypatch.setattr(dag, "postorder", counting)
    (printed,) = TritonPrinter().block([expr], "_mask")
    # each `&` and `|` asked whether its operands read positions by walking them: a walk of the
    # nest below each level, quadratic in the depth (hundreds of times the nodes at depth 60)
    assert sum(walked) <= 10 * nodes, (sum(walked), nodes)
    assert printed.value


def test_a_nest_too_deep_to_print_gets_maskcs_error(monkeypatch):
    """A nest that traces within the recursion limit may still be too deep for the printer,
    which recurses once per level as sympy's printers do (a where-nest of about 110 levels, at
    a depth of the stack that varies with the process: here the printer is made to recurse too
    deeply): a maskc error naming the rule and the fix, not Python's RecursionError."""
    from maskc.codegen import printer

    def too_deep(self, expr):
        raise RecursionError("maximum recursion depth exceeded")
    mask = maskc.mask_mod(_nested(3))
    monkeypatch.setattr(printer.TritonPrinter, "_text", too_deep)
    with pytest.raises(maskc.MaskcError, match="nests too deeply to print") as raised:
        maskc.compile(mask_mod=mask, dtype=torch.float32, head_dim=16, device="cpu")
    assert "as a tensor" in str(raised.value)


@pytest.mark.parametrize("op", ["%", "fmod", "% -inf"])
def test_a_remainder_by_a_captured_infinity_follows_torch(op):
    """x % inf is x where x has the divisor's sign, else the divisor (torch and Python agree),
    and torch.fmod(x, inf) is x; sympy's Mod(x, oo) is nan, which made every comparison false
    and the mask drop every pair without a word."""
    W = float("-inf") if op == "% -inf" else float("inf")

    def mask(b, h, q_idx, kv_idx):
        rest = torch.fmod(q_idx - 3, W) if op == "fmod" else (q_idx - 3) % W
        return (rest < 2) | (rest == W) if op == "% -inf" else rest < 2

    q, k, v = (torch.randn(1, 1, 40, 16, generator=torch.Generator().manual_seed(n)) for n in range(3))
    got = maskc.compiled_attention(q, k, v, mask_mod=mask)
    want, _ = attention_reference(q, k, v, mask_mod=mask)
    assert_close_to_reference(got, want)
