"""Layouts of every tensor argument: strided, expanded, offset (a slice of a larger buffer) and
transposed views give the result of contiguous arguments, bit for bit (the same kernel runs),
for compiled_attention (q, k, v, kv_lens), paged_attention (q, seq_ids, and the cache's page
table and lengths), PagedKVCache.append (seq_ids, k, v) and free (seq_ids), and
maskc.flex_attention's BlockMask tables, eagerly and under torch.compile.

A strided or offset view's gaps hold values a kernel that reads it as contiguous would get
wrong (NaN for floats, a real slot or length for integers), so such a read changes the result."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskc
from maskc.testing import decode_reference
from _inputs import qkv, randn

LAYOUTS = ("contiguous", "strided", "expanded", "offset", "transposed")
F32 = dict(dtype=torch.float32, device="cpu")
FAST = settings(max_examples=15)
DEEP = settings(max_examples=200)


def laid_out(t: torch.Tensor, layout: str, dim: int = 0) -> torch.Tensor:
    """A view in `layout` holding t's values; 'expanded' holds t's first slice along `dim`
    repeated along it (compare with the view's contiguous copy)."""
    gap = float("nan") if t.is_floating_point() else 1
    if layout == "contiguous":
        return t.contiguous()
    if layout == "expanded":
        return t.narrow(dim, 0, 1).clone().expand(t.shape)
    if layout == "offset":  # 5 elements into a larger buffer
        buffer = torch.full((t.numel() + 8,), gap, dtype=t.dtype)
        view = buffer[5:5 + t.numel()].view(t.shape)
    elif layout == "strided":  # every other element along dim
        shape = list(t.shape)
        shape[dim] *= 2
        index = [slice(None)] * t.dim()
        index[dim] = slice(1, None, 2)
        view = torch.full(shape, gap, dtype=t.dtype)[tuple(index)]
    else:  # "transposed": stored with its dims reversed, behind a row of padding
        order = tuple(reversed(range(t.dim() + 1)))
        buffer = torch.full((2, *t.shape), gap, dtype=t.dtype).permute(order).contiguous().permute(order)
        view = buffer[1]
    view.copy_(t)
    return view


@st.composite
def layouts(draw, t: torch.Tensor, *, expand: bool = True) -> torch.Tensor:
    names = LAYOUTS if expand else tuple(name for name in LAYOUTS if name != "expanded")
    return laid_out(t, draw(st.sampled_from(names)), draw(st.integers(0, t.dim() - 1)))


def _ints(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# -- compiled_attention ----------------------------------------------------------------------
MASKS = {"none": None, "causal": maskc.masks.causal, "window": maskc.masks.sliding_window(5)}


@st.composite
def attention_calls(draw, max_kv: int = 40):
    B, Hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2)))
    Lkv = draw(st.integers(4, max_kv))
    decoding = draw(st.booleans())
    Lq = draw(st.integers(1, 4 if decoding else Lkv))
    q, k, v = qkv(B=B, Hq=Hkv * group, Hkv=Hkv, Lq=Lq, Lkv=Lkv, seed=draw(st.integers(0, 99)))
    args = [draw(layouts(t)) for t in (q, k, v)]
    kv_lens = None
    if decoding:
        lens = _ints([draw(st.integers(0, Lkv)) for _ in range(B)], draw(st.sampled_from((torch.int32, torch.int64))))
        kv_lens = draw(layouts(lens))
    return args, kv_lens, draw(st.sampled_from(sorted(MASKS)))


def _attend(args, kv_lens, mask):
    q, k, v = args
    return maskc.compiled_attention(q, k, v, mask_mod=MASKS[mask], enable_gqa=True, kv_lens=kv_lens,
                                    return_lse=True)


def _same_as_contiguous(args, kv_lens, mask):
    got = _attend(args, kv_lens, mask)
    want = _attend([t.contiguous() for t in args], None if kv_lens is None else kv_lens.contiguous(), mask)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@FAST
@given(attention_calls())
def test_compiled_attention_layouts(call):
    _same_as_contiguous(*call)


@pytest.mark.slow
@DEEP
@given(attention_calls(max_kv=150))
def test_compiled_attention_layouts_deep(call):
    _same_as_contiguous(*call)


def test_kv_lens_column_or_expanded_reads_its_own_values():
    """A column of a table (stride 3) and an expanded length: read as contiguous, kv_lens took
    its neighbours' values (errors of 2.1-2.5)."""
    q, k, v = qkv(B=3, Hq=2, Lq=1, Lkv=40)
    table = _ints([[5, 40, 2], [30, 1, 7], [12, 9, 9]])
    for lens in (table[:, 0], _ints([17]).expand(3)):
        out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, kv_lens=lens)
        ref, _ = decode_reference(q, k, v, lens.contiguous(), maskc.masks.causal)
        torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)


# -- the paged cache -------------------------------------------------------------------------
def _filled_cache(seed: int):
    """A cache of 4 slots holding 3 + seed % 7 tokens, slots 1 and 2 then seed % 11 more."""
    cache = maskc.PagedKVCache(32, 4, 2, 16, max_seqs=4, **F32)
    for slots, n in ((_ints([0, 1, 2, 3]), 3 + seed % 7), (_ints([1, 2]), seed % 11)):
        cache.append(slots, randn(len(slots), 2, n, 16, seed=seed), randn(len(slots), 2, n, 16, seed=seed + 1))
    return cache


@st.composite
def paged_calls(draw):
    cache = _filled_cache(draw(st.integers(0, 99)))
    B = draw(st.integers(1, 3))
    slots = _ints(draw(st.lists(st.integers(0, cache.max_seqs - 1), min_size=B, max_size=B)),
                  draw(st.sampled_from((torch.int32, torch.int64))))
    q = randn(B, 4, draw(st.integers(1, 2)), 16, seed=draw(st.integers(0, 99)))
    # the same pages, read through views of the cache's tables or through contiguous copies of those
    viewed, copied = copy.copy(cache), copy.copy(cache)
    viewed.page_table, viewed.lens = draw(layouts(cache.page_table)), draw(layouts(cache.lens))
    copied.page_table, copied.lens = viewed.page_table.contiguous(), viewed.lens.contiguous()
    return viewed, copied, draw(layouts(q)), draw(layouts(slots))


@FAST
@given(paged_calls(), st.sampled_from(sorted(MASKS)))
def test_paged_attention_layouts(call, mask):
    viewed, copied, q, slots = call
    got = maskc.paged_attention(q, viewed, slots, mask_mod=MASKS[mask], enable_gqa=True, return_lse=True)
    want = maskc.paged_attention(q.contiguous(), copied, slots.contiguous(), mask_mod=MASKS[mask], enable_gqa=True,
                                 return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _state(cache) -> tuple:
    """What append and free change, every slot's tokens read back through the table."""
    tokens = [cache.gather(slot) for slot in range(cache.max_seqs)]
    return cache.lens.tolist(), cache._free[:cache.free_pages()].tolist(), tokens


def _cache_ops_agree(seed, slots, k, v, freed):
    """append(slots, k, v) then free(freed) on two equal caches, with the arguments as given
    and as contiguous copies, leaves both caches alike."""
    caches = [_filled_cache(seed) for _ in range(2)]
    for cache, contiguous in zip(caches, (False, True)):
        args = [t.contiguous() if contiguous else t for t in (slots, k, v, freed)]
        cache.append(*args[:3])
        cache.free(args[3])
        cache.check()
    (lens_a, free_a, tokens_a), (lens_b, free_b, tokens_b) = map(_state, caches)
    assert (lens_a, free_a) == (lens_b, free_b)
    for (ka, va), (kb, vb) in zip(tokens_a, tokens_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@FAST
@given(st.data())
def test_cache_append_and_free_layouts(data):
    draw = data.draw
    seed = draw(st.integers(0, 99))
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    slots = _ints(draw(st.permutations(range(4)))[:draw(st.integers(1, 4))], dtype)
    B, T = slots.shape[0], draw(st.integers(1, 6))
    k, v = randn(B, 2, T, 16, seed=seed + 1), randn(B, 2, T, 16, seed=seed + 2)
    freed = _ints(draw(st.permutations(range(4)))[:draw(st.integers(1, 4))], dtype)
    # an expanded slot list names a slot twice, which both layouts refuse
    _cache_ops_agree(seed, draw(layouts(slots, expand=False)), draw(layouts(k)), draw(layouts(v)),
                     draw(layouts(freed, expand=False)))


def test_free_and_append_of_strided_slots_touch_those_slots():
    """ids[::2] names slots 0 and 2; read as contiguous it named 0 and 1: free emptied slot 1,
    a live sequence, and kept slot 2, and append grew slot 1."""
    cache = _filled_cache(0)
    lens = cache.lens.tolist()
    ids = torch.arange(4)
    cache.free(ids[::2])
    assert cache.lens.tolist() == [0, lens[1], 0, lens[3]]
    cache.append(ids[::2], randn(2, 2, 3, 16), randn(2, 2, 3, 16))
    assert cache.lens.tolist() == [3, lens[1], 3, lens[3]]


def test_paged_attention_reads_strided_slots():
    cache = _filled_cache(1)
    q = randn(2, 4, 1, 16)
    ids = torch.arange(4, dtype=torch.int32)  # (int64 was narrowed into a contiguous copy)
    out = maskc.paged_attention(q, cache, ids[1::2], mask_mod=maskc.masks.causal, enable_gqa=True)
    assert torch.equal(out, maskc.paged_attention(q, cache, _ints([1, 3]), mask_mod=maskc.masks.causal,
                                                  enable_gqa=True))


# -- torch.compile and the flex drop-in ------------------------------------------------------
def test_layouts_under_torch_compile():
    """The operators (maskc::decode, maskc::paged_attention) take the views as inputs."""
    cache = _filled_cache(5)
    q, k, v = qkv(B=3, Hq=4, Hkv=2, Lq=1, Lkv=30)
    table = _ints([[5, 9], [30, 1], [12, 4]])

    def step(q, k, v, lens, slots):
        return (maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True, kv_lens=lens),
                maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    slots = _ints([[3, 0], [0, 0], [1, 0]])[:, 0]
    for lens in (table[:, 0], _ints([17]).expand(3)):
        got = compiled(laid_out(q, "strided", 2), k, v, lens, slots)
        want = step(q, k, v, lens.contiguous(), slots.contiguous())
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_flex_block_mask_tables_in_any_layout():
    """A BlockMask built from strided and offset views of its tables runs as from contiguous ones."""
    from torch.nn.attention.flex_attention import BlockMask

    q = randn(1, 2, 64, 16)
    counts = _ints([[[1, 2, 3, 4]]])
    indices = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4).contiguous()
    block_masks = [BlockMask.from_kv_blocks(c, i, BLOCK_SIZE=16, mask_mod=maskc.masks.causal, seq_lengths=(64, 64))
                   for c, i in ((counts, indices), (laid_out(counts, "strided", 2), laid_out(indices, "offset")))]
    outs = [maskc.flex_attention(q, q, q, block_mask=bm) for bm in block_masks]
    assert torch.equal(*outs)
