"""The runtime's public functions: compiled_attention(), paged_attention() and compile()."""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from maskc._graph import outside_graph
from maskc.analysis.blockmap import BlockMap
from maskc.inference import decode
from maskc.runtime import dispatch, launch, ops, plan
from maskc.runtime.autograd import AttentionFunction, NoPairs
from maskc.runtime.dropout import check_dropout, draw
from maskc.runtime.dtypes import DTYPES
from maskc.runtime.kernel import CompiledKernel, kernel_for
from maskc.runtime.sinks import check_sinks, with_sinks
from maskc.inference.paged import PagedKVCache
from maskc.runtime.tiles import check_block_size
from maskc.trace.mods import (MaskMod, ScoreMod, as_mask_mod, as_score_mod, captured_need_grad_for_dynamo,
                              captured_needing_grad)

# What Dynamo says where a plain function reaches compiled_attention under torch.compile: the
# operator names a mod by the key maskc gave it when it traced it, and Dynamo must not trace
# maskc's tracer. Such a call runs outside the graph (a graph break; with fullgraph=True,
# Dynamo's error with this reason), as Dynamo runs any Python it cannot trace: it had raised
# a TypeError there, which Dynamo took for a graph break and went on to trace maskc's eager
# path and Triton's interpreter, crashing and leaving the compiled function broken for later
# calls.
PLAIN_FUNCTION = ("maskc: a plain function as mask_mod or score_mod runs outside the graph; decorate it with "
                  "@maskc.mask_mod or @maskc.score_mod, or wrap it once outside the compiled function "
                  "(maskc.mask_mod(fn)), to keep the call in the graph (with fullgraph=True, the only way: a mod "
                  "made inside the compiled function cannot be traced there)")
# Where a mod's captured tensor requires grad: the operators' autograd has no inputs for it, but
# the eager autograd Function has, so the call runs outside the graph too (it had been refused
# there, which Dynamo took for a graph break, crashing in Triton's interpreter on CPU).
CAPTURED_GRADIENTS = ("maskc: a captured tensor that requires grad gets its gradient from maskc's eager autograd, "
                      "outside the graph; detach it inside the compiled code to keep the call in the graph")


# Where dropout draws from a generator of the caller's: the graph's draw takes torch's default
# generator only (Dynamo does not trace a torch.Generator argument), so the call runs outside it.
WITH_GENERATOR = ("maskc: dropout with generator= runs outside the graph; under torch.compile leave generator=None "
                  "(dropout draws from torch's default generator, which torch.manual_seed seeds)")


def plain_function(mask_mod, score_mod) -> bool:
    """Whether a mod is neither None nor traced by maskc yet (a MaskMod or ScoreMod)."""
    return (mask_mod is not None and not isinstance(mask_mod, MaskMod)) or (
        score_mod is not None and not isinstance(score_mod, ScoreMod))


def plain_block_mask(block_map) -> bool:
    """Whether `block_map` is a torch BlockMask holding a mask_mod maskc has not traced (torch's
    create_block_mask keeps the function it was given), which the operator cannot name."""
    return isinstance(block_map, BlockMask) and plain_function(block_map.mask_mod, None)


def compiled_attention(q, k, v, mask_mod=None, score_mod=None, scale=None, enable_gqa=False, return_lse=False,
                       block_map: BlockMap | None = None, kv_lens: torch.Tensor | None = None,
                       sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
                       generator: torch.Generator | None = None):
    """Attention with a specialised, tile-skipping kernel; differentiable in q, k and v.

    q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv] (FlexAttention's shapes); k and
    v may have batch 1, shared by every batch of q.
    Returns out [B, Hq, Lq, Dv], or (out, lse) with lse [B, Hq, Lq] in natural log (float32;
    float64 for float64 inputs, which exist for gradcheck and run slowly); both differentiable.
    Rows with no kept key give out = 0 and lse = -inf. CPU tensors run the same generated
    kernel through Triton's interpreter. A negative index into a captured tensor counts from
    its end (as torch's); one still out of range reads 0.
    A block_map must come from maskc.block_map() for this mask, its values and captured
    tensors, with tiles that are powers of two from 16 to 256 (any of them: the kernels read
    it at their own tiles); without mask_mod, the map's own mask runs (as FlexAttention takes
    a BlockMask's). A torch BlockMask (create_block_mask, maskc's or torch's) is taken too, as
    maskc.flex_attention takes it: its tiles decide which blocks run, its own mask_mod the
    pairs of the others (pass mask_mod=None, or the same one).

    The kernels read the mods' captured tensors at every call; the block map built from the
    mask's is reused while each tensor's version and storage are unchanged, which any write
    through torch changes (an in-place op, `t.data = other`). After a write torch cannot see
    (into the numpy array under torch.from_numpy), call maskc.invalidate(t). A captured tensor
    changed between a forward and its backward raises, as autograd does for saved tensors.

    kv_lens, an int tensor [B], is for decoding and chunked prefill (no gradients): keys at
    positions >= kv_lens[b] are ignored, and the Lq queries are the last Lq tokens, at
    positions kv_lens[b] - Lq + i, which mask_mod and score_mod see (so masks.causal is right
    at every step); a query before position 0 gets out 0 and lse -inf. A block_map is then
    built over Lkv × Lkv positions. Few query rows (Lq · Hq/Hkv <= 64) without gradients
    take the split-KV decoding kernel.

    sinks, a float tensor [Hq] that may require grad, is one logit per query head (gpt-oss's
    attention sinks) that joins every row's softmax denominator and carries no value: per row,
    out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sinks[h]}) and lse = log(Σ_j e^{s_j} + e^{sinks[h]}),
    s_j the scaled, score-modded scores of the kept keys; the sink logit itself is neither scaled
    nor score-modded. A row with no kept key gives out 0 and lse sinks[h]. Its gradient flows
    with or without kv_lens.

    dropout_p drops each kept probability with that probability and scales the survivors by
    1/(1 - dropout_p), as SDPA's: out = (softmax(S) ∘ Z / (1 - p)) V, the lse unchanged (pass
    dropout_p=p if training else 0.0, as SDPA takes it). The keep-mask Z comes from a Philox
    generator inside the kernels, seeded by one draw from `generator` (a torch.Generator on q's
    device) or torch's default generator: re-seeding reproduces a call bit for bit, the backward
    regenerates the same Z, and maskc.testing.dropout_keep gives it. Not with kv_lens (decoding
    has no dropout); sinks then join the dropped probabilities' softmax as an extra key. Under
    activation checkpointing use torch's default generator, whose state checkpointing restores
    for the recomputed forward (a generator of yours draws another seed there). Under
    torch.compile the seed is drawn in the graph from the default generator (Inductor's random
    stream, not eager's: dropout_keep reproduces eager and aot_eager calls) and each distinct
    dropout_p is a constant of the graph (a new value compiles a new one).

    >>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.sliding_window(1024))
    >>> out = maskc.compiled_attention(q_step, k_cache, v_cache, mask_mod=maskc.masks.causal, kv_lens=lens)
    >>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, sinks=module.sinks)
    """
    if generator is not None or not isinstance(dropout_p, (int, float)) or dropout_p:
        check_dropout(dropout_p, generator, q, kv_lens)
    if isinstance(block_map, BlockMask) and mask_mod is not None and mask_mod is not block_map.mask_mod:
        raise ValueError("a BlockMask carries its own mask_mod, whose tiles it lists; pass mask_mod=None to run it, or "
                         "build the BlockMask from this mask_mod (maskc.create_block_mask(mask_mod, ...))")
    if torch.compiler.is_compiling():
        if plain_function(mask_mod, score_mod) or plain_block_mask(block_map):
            return _compiled_attention_outside_graph(q, k, v, mask_mod, score_mod, scale, enable_gqa, return_lse,
                                                   block_map, kv_lens, sinks, dropout_p, generator)
        if kv_lens is None and captured_need_grad_for_dynamo(mask_mod, score_mod):
            return _compiled_attention_for_gradients(q, k, v, mask_mod, score_mod, scale, enable_gqa, return_lse,
                                                     block_map, sinks=sinks, dropout_p=dropout_p, generator=generator)
        if generator is not None and dropout_p:
            return _compiled_attention_with_generator(q, k, v, mask_mod, score_mod, scale, enable_gqa, return_lse,
                                                      block_map, sinks=sinks, dropout_p=dropout_p, generator=generator)
        # Dynamo traces this branch alone: maskc's Python runs inside the operators (runtime/ops.py),
        # and the sinks' epilogue in the graph, outside them
        if sinks is not None:
            check_sinks(sinks, q)
        if kv_lens is not None:
            if isinstance(block_map, BlockMask):
                raise TypeError("under torch.compile, a call with kv_lens takes a maskc.BlockMap, not a torch "
                                "BlockMask; build it with maskc.block_map(mask_mod, kv_len, kv_len) outside the "
                                "compiled code")
            out, lse = ops.decode(q, k, v, kv_lens, mask_mod, score_mod, scale, enable_gqa, block_map)
        else:
            differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            out, lse = ops.attention(q, k, v, mask_mod, score_mod, scale, enable_gqa, block_map, differentiable,
                                     dropout_p)
        return _result(out, lse, sinks, return_lse)
    plan.check_tensors(q, k, v, enable_gqa)
    if sinks is not None:
        check_sinks(sinks, q)
    if isinstance(block_map, BlockMask):  # as maskc.flex_attention takes one: converted once, then found again
        block_map = ops.converted_block_mask(block_map)
    mask, score = plan.mask_of_call(as_mask_mod(mask_mod), block_map), as_score_mod(score_mod)
    B, Hq, Lq, D = q.shape
    if k.shape[0] != B:
        # views over q's batch: autograd sums their gradients back into k and v
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    differentiable = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v))
                                                  or bool(captured_needing_grad(*plan.traces_of(mask, score))))
    chosen = dispatch.family(q, k, differentiable, block_map, kv_lens, dropping=bool(dropout_p))
    if chosen == dispatch.NO_PAIRS:
        out, lse = NoPairs.apply(q, k, v) if differentiable else launch.no_pairs(q, v)
        return _result(out, lse, sinks, return_lse)
    if chosen == dispatch.DECODE:
        if differentiable:
            raise NotImplementedError("kv_lens is for decoding and chunked prefill, which maskc runs without "
                                      "gradients; call it under torch.no_grad(), or detach q, k, v and the mods' "
                                      "captured tensors")
        out, lse = decode.contiguous(q, k, v, mask, score, scale, kv_lens, block_map)
        return _result(out, lse, sinks, return_lse)
    problem = dispatch.prefill_problem(q, k, v, mask, score, scale, block_map)
    dropout = draw(dropout_p, generator, q.device)
    if differentiable:
        out, lse = AttentionFunction.apply(q, k, v, problem, dropout, *problem.grad_tensors)
    else:
        out, lse = launch.forward(q, k, v, problem, dropout)
    return _result(out, lse, sinks, return_lse)


def _result(out, lse, sinks, return_lse: bool):
    """What an entry point returns from its kernels' (out, lse): the one place sinks join."""
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def paged_attention(q, cache: PagedKVCache, seq_ids, *, mask_mod=None, score_mod=None, scale=None,
                    enable_gqa=False, return_lse=False, sinks: torch.Tensor | None = None, dropout_p: float = 0.0):
    """Attention of q over the sequences `seq_ids` of a paged cache, without gradients.

    q [B, Hq, Lq, D] holds the queries of the last Lq tokens of each listed sequence, whose
    keys and values are already appended; seq_ids is an int tensor [B] of the cache's slots.
    As with compiled_attention's kv_lens, query i of sequence b sits at position
    lens[slot] - Lq + i and mask_mod and score_mod see logical positions (b is the index in
    this batch). A step does no host synchronisation and allocates only its outputs, so it
    can be captured in a CUDA graph once a first call has planned it. sinks [Hq] are attention
    sinks, as compiled_attention's (their gradient flows; q's and the cache's do not).
    dropout_p is taken so that a layer can pass `dropout_p=p if training else 0.0` to either
    entry point: paged attention decodes, and decoding has no dropout, so any value but 0.0
    raises ValueError.

    >>> cache.append(seq_ids, k_new, v_new)
    >>> out = maskc.paged_attention(q, cache, seq_ids, mask_mod=maskc.masks.causal, enable_gqa=True)
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a maskc.PagedKVCache, got {type(cache).__name__}")
    if dropout_p:
        check_dropout(dropout_p, None, q)  # a value outside [0, 1) gets the range's message
        raise ValueError(f"dropout is for training, and paged attention decodes, which has none: got "
                         f"dropout_p={dropout_p}; pass dropout_p=0.0 when decoding (dropout_p=p if training "
                         f"else 0.0)")
    if torch.compiler.is_compiling():
        if plain_function(mask_mod, score_mod):
            return _paged_attention_outside_graph(q, cache, seq_ids, mask_mod=mask_mod, score_mod=score_mod,
                                                   scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                                   sinks=sinks)
        if sinks is not None:
            check_sinks(sinks, q)
        out, lse = ops.paged(q, cache.k_pages, cache.v_pages, cache.page_table, cache.lens, seq_ids, cache.page_size,
                             mask_mod, score_mod, scale, enable_gqa)
        return _result(out, lse, sinks, return_lse)
    if sinks is not None:
        check_sinks(sinks, q)
    out, lse = decode.paged(q, cache.k_pages, cache.v_pages, cache.page_table, cache.lens, seq_ids, cache.page_size,
                            as_mask_mod(mask_mod), as_score_mod(score_mod), scale, enable_gqa)
    return _result(out, lse, sinks, return_lse)


_compiled_attention_outside_graph = outside_graph(compiled_attention, PLAIN_FUNCTION)
_compiled_attention_for_gradients = outside_graph(compiled_attention, CAPTURED_GRADIENTS)
_compiled_attention_with_generator = outside_graph(compiled_attention, WITH_GENERATOR)
_paged_attention_outside_graph = outside_graph(paged_attention, PLAIN_FUNCTION)


def invalidate(tensor: torch.Tensor | None = None) -> int:
    """Forget the plans, block maps and decoding plans built from `tensor`'s values (all of them
    where `tensor` is None); returns how many were dropped.

    maskc builds a call's block map from its mask's captured tensors once, and finds it again
    by each tensor's version and storage, which every write through torch changes (an in-place
    op, `copy_`, `t.data = other`). A write torch does not see, into the numpy array under
    `torch.from_numpy` or into memory another library shares, changes neither: call this after
    such a write, with the captured tensor or any tensor over the same memory. A BlockMap you
    built yourself is not a cache: build it again.

    >>> ids = torch.from_numpy(buf)    # captured by the mask
    >>> buf[:] = next_doc_ids          # a write torch does not see
    >>> maskc.invalidate(ids)
    """
    if tensor is None:
        return sum(cache.drop(lambda _: True) for cache in (plan.PLANS, plan.BLOCK_MAPS, decode.DECODES))
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"maskc.invalidate takes a torch.Tensor (or nothing, to drop every plan), got "
                        f"{type(tensor).__name__}; for a numpy array pass torch.from_numpy(array)")
    storage = tensor.untyped_storage()
    start, device = storage.data_ptr(), storage.device

    def reads(traces) -> bool:
        for x in (x for t in traces if t is not None for x in t.tensors):
            other = x.untyped_storage()
            lo = other.data_ptr()
            if other.device == device and lo < start + storage.nbytes() and start < lo + other.nbytes():
                return True
        return False
    return (plan.PLANS.drop(lambda p: reads((p.mask, p.score))) + plan.BLOCK_MAPS.drop(lambda bm: reads((bm.traced,)))
            + decode.DECODES.drop(lambda d: reads((d.mask, d.score))))


def compile(mask_mod=None, score_mod=None, *, dtype=torch.bfloat16, head_dim: int = 128,
            head_dim_v: int | None = None, enable_gqa: bool = False, block_size=None, device=None) -> CompiledKernel:
    """The forward kernel specialised to `mask_mod` and `score_mod`, from cache or freshly generated.

    One kernel file serves every head dim, tile size and (but float64) dtype: those are launch
    values, checked here as compiled_attention() would.

    >>> kernel = maskc.compile(mask_mod=maskc.masks.causal, dtype=torch.bfloat16, head_dim=128)
    >>> print(kernel.source)     # the Triton source that runs
    >>> kernel.path              # where it is cached on disk
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype}; cast q, k and v")
    plan.check_head_dims(head_dim, head_dim_v or head_dim, names=("head_dim", "head_dim_v"))
    if block_size is not None:
        check_block_size(block_size)
    mask, score = as_mask_mod(mask_mod), as_score_mod(score_mod)
    return kernel_for("fwd", mask.traced if mask else None, score.traced if score else None, dtype, device)


__all__ = ["compile", "compiled_attention", "invalidate", "paged_attention"]
