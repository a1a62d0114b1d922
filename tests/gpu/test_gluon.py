"""The Gluon Hopper kernels (templates/attention_fwd_hopper.py.jinja, attention_bwd_hopper.py.jinja)
under MASKC_GLUON=always, against the float64 reference.

The CPU suite cannot run Gluon (the interpreter runs only Triton's language), so this is its
check: every case asserts that the Gluon forward and the dK/dV kernel computing dQ ran, and
compares out, lse, dq, dk and dv with the reference, on ragged lengths, GQA, D=64 and 128, bf16
and fp16: the workloads' masks and score mods, mods written to reach the printer's corners, q, k
and v in a model's memory order, and hypothesis-drawn masks and score mods.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from maskc import masks, scores
from maskc.testing import strategies

from ._common import check_gluon, drawn, examples, lane_sample

pytestmark = pytest.mark.usefixtures("gluon_kernels")

# name: (B, Hq, Hkv, Lq, Lkv, D, dtype); lengths the Gluon kernels run at: at least 64 queries and 128 keys
SHAPES = {
    "B2-H4-1000x777-D64": (2, 4, 4, 1000, 777, 64, torch.bfloat16),
    "B1-GQA8:2-333x1029-D128-fp16": (1, 8, 2, 333, 1029, 128, torch.float16),
    "B1-H2-128x4096-D128": (1, 2, 2, 128, 4096, 128, torch.bfloat16),
    "B2-GQA3:1-4097x300-D64-fp16": (2, 3, 1, 4097, 300, 64, torch.float16),
    "B1-H2-65x129-D128": (1, 2, 2, 65, 129, 128, torch.bfloat16),
}


def late_keys(score, b, h, q_idx, kv_idx):
    # a split score mod whose first kv tiles are -inf in every row
    return score + torch.where(kv_idx >= 40, 0.0, float("-inf"))


def float_literals_rounded(b, h, q_idx, kv_idx):
    # index arithmetic with float literals, rounded and compared: read as the rationals they spell
    return (((q_idx - kv_idx) * 0.1).int() >= 0) & (torch.floor(kv_idx / 3.0) <= q_idx * 0.5 + 40)


def narrow_casts(score, b, h, q_idx, kv_idx):
    # rounded to bfloat16 and float16 inside the mod (the bfloat16 rounding by its bits)
    return score.to(torch.bfloat16).to(torch.float32) + (score * 0.5).half()


def late_rows(b, h, q_idx, kv_idx):
    # causal from row 70: the first q tile's rows keep nothing, so no program of the dK/dV
    # kernel adds into that tile's dQ
    return (q_idx >= 70) & (kv_idx <= q_idx)


def arctangent(score, b, h, q_idx, kv_idx):
    # the prelude's own arctangent, across both of its range reductions
    return score + 4 * torch.atan((q_idx - kv_idx).float() ** 3 / 1000 + score / 8)


def _with_tables(Lq, Lkv, H):
    """The mods that read captured tables, by name, their tensors on the GPU."""
    n = max(Lq, Lkv)
    g = torch.Generator().manual_seed(0)
    docs = torch.randint(0, 4, (n,), generator=g).sort().values.cuda()
    table = torch.randn(H, 2 * n - 1, generator=g).cuda()
    distance = torch.randn(2 * n - 1, generator=g).cuda()
    positions = torch.arange(n, device="cuda")
    squares = (positions * positions).float()
    rates, thirds = (positions + 1.0) * 0.1, torch.full_like(positions, 3.0, dtype=torch.float32) / (positions + 1)

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + distance[q_idx - kv_idx]  # a negative index counts from the end, as torch's

    def table_ratio(b, h, q_idx, kv_idx):
        return rates[q_idx] / rates[kv_idx] >= 1  # one division: the diagonal is exactly 1.0

    def number_over_an_index(b, h, q_idx, kv_idx):
        return 3 / (kv_idx + 1) >= thirds[q_idx]  # torch's 3 / x is x.reciprocal() * 3; no FMA

    def product_over_a_table(b, h, q_idx, kv_idx):
        return (kv_idx + 1) * thirds[q_idx] <= 3  # torch rounds the product: no FMA

    def root_of_a_square(b, h, q_idx, kv_idx):
        return torch.sqrt(squares[q_idx]) >= kv_idx  # causal: the root is exact in torch

    def over_a_table(score, b, h, q_idx, kv_idx):
        return score + rates[kv_idx] / rates[q_idx]

    return {
        "negative index": (masks.causal, from_the_end),
        "table ratio": (table_ratio, over_a_table),
        "number over an index": (number_over_an_index, None),
        "product over a table": (product_over_a_table, None),
        "root of a square": (root_of_a_square, None),
        "document": (masks.document(docs, causal=True), None),
        "ALiBi causal": (masks.causal, scores.alibi(scores.alibi_slopes(H).cuda())),
        "relative bias": (masks.causal, scores.relative_bias(table, offset=n - 1)),
    }


PLAIN = {
    "float literals rounded": (float_literals_rounded, narrow_casts),
    "arctangent": (masks.causal, arctangent),
    "no mask": (None, None),
    "causal": (masks.causal, None),
    "late rows": (late_rows, None),
    "sliding 100": (masks.sliding_window(100), None),
    "prefix-LM 300": (masks.prefix_lm(300), None),
    "softcap": (None, scores.softcap(20.0)),
    "late keys": (masks.causal, late_keys),
}
TABLES = ("negative index", "table ratio", "number over an index", "product over a table", "root of a square",
          "document", "ALiBi causal", "relative bias")
# each case at one shape (each case's kernels compile for its head dim and dtype: 10-20 s); the lane
# takes the cases that reach the Gluon kernels' own corners
SHAPE_OF = {case: list(SHAPES)[i % len(SHAPES)] for i, case in enumerate([*PLAIN, *TABLES])}
LANE = ("causal", "late rows", "number over an index", "relative bias")
CASES = lane_sample(list(SHAPE_OF.items()), lambda i, v: v[0] in LANE, ids=lambda v: f"{v[0]}-{v[1]}")


def _inputs(shape: str, layout: str = "BHLD"):
    B, Hq, Hkv, Lq, Lkv, D, dtype = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(s, generator=g).to(dtype=dtype, device="cuda")
           for s in ((B, Hq, Lq, D), (B, Hkv, Lkv, D), (B, Hkv, Lkv, D))]
    if layout == "BLHD":  # a model's memory order, (B, L, H, D) seen as (B, H, L, D)
        qkv = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv]
    return qkv


def _mods(case: str, shape: str):
    if case in PLAIN:
        return PLAIN[case]
    B, Hq, Hkv, Lq, Lkv, D, dtype = SHAPES[shape]
    return _with_tables(Lq, Lkv, Hq)[case]


@pytest.mark.parametrize("case, shape", CASES)
def test_named(case, shape):
    check_gluon(*_inputs(shape), *_mods(case, shape))


@pytest.mark.parametrize("case", lane_sample(["no mask", "causal", "document", "ALiBi causal"],
                                             lambda i, v: v == "causal"))
def test_model_memory_order(case):
    """q, k and v in a model's memory order, at the case's shape (its kernels are test_named's)."""
    check_gluon(*_inputs(SHAPE_OF[case], "BLHD"), *_mods(case, SHAPE_OF[case]))


@examples(2, 30)
def test_drawn(examples):
    """Hypothesis-drawn masks and score mods (the CPU suite's strategies) at lengths the Gluon
    kernels run at."""
    @drawn(examples)
    @given(data=st.data(), Lq=st.integers(65, 700), Lkv=st.integers(128, 700), D=st.sampled_from([64, 128]),
           gqa=st.booleans(), seed=st.integers(0, 2 ** 16))
    def one(data, Lq, Lkv, D, gqa, seed):
        Hq, Hkv = (4, 2) if gqa else (2, 2)
        mask = data.draw(strategies.masks(Lq, Lkv, H=Hq, device="cuda"), label="mask")
        score = data.draw(strategies.score_mods(Lq, Lkv, H=Hq, device="cuda"), label="score")
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, h, n, D, generator=g).to(dtype=torch.bfloat16, device="cuda")
                   for h, n in ((Hq, Lq), (Hkv, Lkv), (Hkv, Lkv)))
        check_gluon(q, k, v, mask, score)

    one()
