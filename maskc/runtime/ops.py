"""compiled_attention under torch.compile: the forward and backward as PyTorch operators.

Dynamo must not trace maskc's Python (sympy tracing, plans, block maps, launches), and
`fullgraph=True` allows no graph break, so under Dynamo compiled_attention calls `attention()`
here, which Dynamo traces: it reads the handles of the call's MaskMod, ScoreMod and BlockMap
(each one's serial number as a tensor, made when it was built; maskc finds the object by its
handle while it lives). A handle is a graph input, guarded on shape and dtype alone, so a new
mod or map of the same kind (a factory's new window, new document ids, a new map each batch)
runs the same graph. The graph records one operator,
`maskc::attention(q, k, v, mask_handle, score_handle, map_handle, scale, enable_gqa, ..., seed, keep_min) ->
(out, lse, token)` (seed and keep_min: the dropout's, maskc/runtime/dropout.py). The decoding
operators name mods by their keys (strings) instead: a CUDA graph may record them, and it takes
no CPU tensor as an input.
(An earlier version named the call through `torch.compiler.assume_constant_result`, which
torch 2.11's Dynamo refuses for arguments that are not constants.)

The operators are `torch.library.custom_op`s, opaque to the compiler: at run time their
implementations do what the eager call does (the mods' traces, re-checked by their guards; the
plan and block map, from the runtime's caches; the launches). So the mods' captured values, read
when the operator runs, never enter the graph or its guards: a new document-id tensor or window
value, and the new block map it makes, recompile nothing. (`triton_op` with `wrap_triton` would
have the compiler trace the planning Python, baking those values into the graph, and cannot run
Triton's interpreter for CPU tensors.)

The backward operator runs with the forward's own plan, as the eager autograd Function does:
the forward returns a token, a CPU int64 scalar naming its plan. Decoding (kv_lens) and
paged_attention have operators of their own, `maskc::decode` and `maskc::paged_attention`,
without gradients.
"""
from __future__ import annotations

import inspect
import itertools
import threading
import warnings
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import BlockMask

from maskc.analysis.blockmap import BlockMap
from maskc.errors import MaskcError
from maskc.inference import decode as decoding
from maskc.runtime import dispatch, launch, plan, state
from maskc.runtime import dropout as dropping
from maskc.runtime.autograd import refuse_second_derivatives
from maskc.runtime.tiles import kernel_tiles_of
from maskc.settings import plan_cache_max_size
from maskc.trace.mods import (MaskMod, ScoreMod, as_mask_mod, captured_need_grad_for_dynamo, captured_needing_grad,
                              mod_of_handle, mod_of_key)

_lock = threading.Lock()

# Tokens: a serial number per plan, while the plan lives, so that a repeated call returns the
# same token (torch.library.opcheck compares repeated runs); the plans of the most recent tokens
# are held for their backward, which bounds the memory held whatever runs. The bound is a count:
# a plan holds its captured tensors, which plan.PLANS bounds by bytes too. A token is never
# given to another plan, so a backward whose plan was dropped finds none and raises, never
# running another plan.
_PENDING = 1024
_NO_PAIRS = -1  # the token of a forward with no (q, kv) pair: its backward gives zeros
_NO_BACKWARD = -2  # the token of a forward that recorded none (the decoding kernel's)
_serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
state.register(__name__, "_serials", "the token of each live plan run by the torch.compile operator",
               "weak: an entry goes with its plan; not cleared, so that a repeated call keeps its token",
               size=lambda: len(_serials), clear=None)
_forwards = state.lru(__name__, "_forwards", "the plans of the latest forwards under torch.compile, by token, for "
                      "their backwards", _PENDING)
_counter = itertools.count()

# The operators whose every call must run their Python: they read the mods' captured values, a
# block map's or cache's state and the plan caches when they run, which a CUDA graph's replay
# would skip, replaying the values of its recording. Tagged so, Inductor's CUDA graphs
# (mode="reduce-overhead", transformers' static-cache generate()) leave them out of the graph
# and run them between its parts (graph partition), or skip CUDA graphs where partitioning is off.
# (custom_op takes tags from torch 2.8.)
_PYTHON_EACH_CALL = ({"tags": (torch.Tag.cudagraph_unsafe,)}
                     if "tags" in inspect.signature(torch.library.custom_op).parameters else {})


def attention(q, k, v, mask_mod, score_mod, scale, enable_gqa: bool, block_map, differentiable: bool,
              dropout_p: float = 0.0):
    """(out, lse) of compiled_attention through the maskc operators; what Dynamo traces.
    `differentiable`: whether autograd may record a backward, which the operator needs to choose
    the kernel as the eager call does (the decoding kernel serves only calls without one).
    With dropout_p, the seed is drawn here, in the graph, from torch's default generator
    (maskc/runtime/dropout.py), and handed to the operator and its backward as an input.

    The mods and a BlockMap are named by their handles (serial numbers as tensors: graph inputs,
    which Dynamo guards on shape and dtype alone), so a new mod or map of the same kind runs the
    same graph: a factory's new window, new document ids or a new map each step recompile
    nothing, and the values are read by the operator when it runs. A torch BlockMask (from
    maskc.flex_attention) is named by its tile tensors, converted when the operator runs."""
    handle, tiles, layout = None, [], [0, 0, 0, 0]
    if isinstance(block_map, BlockMask):
        mask_mod = block_map.mask_mod if mask_mod is None else mask_mod
        tiles = [block_map.kv_num_blocks, block_map.kv_indices]
        if block_map.full_kv_num_blocks is not None:
            tiles += [block_map.full_kv_num_blocks, block_map.full_kv_indices]
        layout = [*block_map.seq_lengths, *block_map.BLOCK_SIZE]
        _checked(mask_mod, MaskMod, "the mask_mod of a BlockMask", "build it with maskc.create_block_mask, or wrap "
                 "the function once: create_block_mask(maskc.mask_mod(fn), ...)")
    else:
        mask_mod = plan.mask_of_call(mask_mod, block_map)
        handle = block_map.handle if block_map is not None else None
        _checked(mask_mod, MaskMod, "mask_mod")
    _checked(score_mod, ScoreMod, "score_mod")
    mods = tuple(None if mod is None else mod.handle for mod in (mask_mod, score_mod))
    # here, where Dynamo traces the call, and not only where the graph records a backward:
    # where q, k and v need no gradient no backward is recorded, and the captured tensor's
    # gradient would be missing without a word
    _refuse_traced_captured_gradients(mask_mod, score_mod)
    drawn = dropping.draw(dropout_p, None, q.device)
    out, lse, _ = torch.ops.maskc.attention(q, k, v, *mods, handle, None if scale is None else float(scale),
                                            enable_gqa, tiles, layout, differentiable,
                                            *((drawn.seed, drawn.keep_min) if drawn else (None, 0)))
    return out, lse


def _checked(mod, kind, what: str, fix: str | None = None) -> None:
    """Refuse a mod an operator cannot name: anything but None or a `kind` (MaskMod, ScoreMod)."""
    if mod is not None and not isinstance(mod, kind):
        fix = fix or (f"decorate the function with @maskc.{what}, or wrap it once outside the compiled code: "
                      f"maskc.{what}(fn)")
        raise TypeError(f"under torch.compile, {what} must be a maskc.{kind.__name__} ({fix}), got "
                        f"{type(mod).__name__}")


def _key(mod, kind, what: str) -> str:
    """The key naming `mod` ("" for None) in the operators a CUDA graph may record: a string,
    since such a graph takes no CPU tensor (a handle) as an input."""
    _checked(mod, kind, what)
    return "" if mod is None else mod.key


# -- forward ---------------------------------------------------------------------------------
@torch.library.custom_op("maskc::attention", mutates_args=(), **_PYTHON_EACH_CALL)
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_handle: torch.Tensor | None,
             score_handle: torch.Tensor | None, map_handle: torch.Tensor | None, scale: float | None, enable_gqa: bool,
             flex_tiles: list[torch.Tensor], flex_layout: list[int], differentiable: bool,
             seed: torch.Tensor | None, keep_min: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask, score, block_map, k, v = _inputs(mask_handle, score_handle, map_handle, q, k, v)
    if differentiable:  # a mod named by a handle may be another than the one the graph was traced with
        _refuse_captured_gradients(mask, score)
    if mask is not None or score is not None:
        _note_structure(mask, score)
    if flex_tiles:
        block_map = converted(flex_tiles, flex_layout[:2], flex_layout[2:], mask)
    dropout = None if seed is None else dropping.Dropout(seed, keep_min)
    # the eager call's choice, on a converted map too
    chosen = dispatch.family(q, k, differentiable, block_map, dropping=dropout is not None)
    if chosen == dispatch.NO_PAIRS:
        out, lse = launch.no_pairs(q, v)
        return out, lse, torch.tensor(_NO_PAIRS)
    if chosen == dispatch.DECODE:
        out, lse = decoding.contiguous(q, k, v, mask, score, scale, None, block_map)
        return out, lse, torch.tensor(_NO_BACKWARD)
    problem = dispatch.prefill_problem(q, k, v, mask, score, scale, block_map)
    out, lse = launch.forward(q, k, v, problem, dropout)
    return out, lse, torch.tensor(_token(problem))


@_forward.register_fake
def _forward_fake(q, k, v, mask_handle, score_handle, map_handle, scale, enable_gqa, flex_tiles, flex_layout,
                  differentiable, seed, keep_min):
    # runs at trace time: wrong inputs fail there, with the eager call's errors
    plan.check_tensors(q, k, v, enable_gqa)
    return *launch.outputs(q, v.shape[3]), torch.empty((), dtype=torch.int64)


# The BlockMaps of torch BlockMasks' tile tensors, eager calls' (maskc.flex_attention) and the
# operator's alike: a compiled graph hands the operator the tensors alone, on every call. Keyed by
# what the map is made of, not by the tensors' identity: a graph may pass new tensors of the same
# values, or the same tensor written in place (its _version moves). An entry holds the tensors,
# so no other tensor takes their addresses while it lives, and the map, which holds the mask's
# trace and its captured tensors' storages (Traced.stamps). Bounded by count and bytes like
# plan.PLANS: a loop that makes a new BlockMask per step keeps the latest ones only.
CONVERTED = state.lru(__name__, "CONVERTED", "the BlockMap of each torch BlockMask's tile tensors (held with it), "
                      "lengths, BLOCK_SIZE and mask_mod trace", 64,
                      lambda entry: plan.held_bytes(entry[0], entry[1].traced.storages(), (entry[1],)),
                      plan_cache_max_size)


def converted(tiles, seq_lengths, block_size, mask: MaskMod) -> BlockMap:
    """The BlockMap of a torch BlockMask's tiles (kv_num_blocks, kv_indices and, where it lists
    them, full_kv_num_blocks, full_kv_indices) with the mask_mod `mask`, at the kernels' tiles;
    converted (BlockMap.from_flex_tiles) again only when a tile tensor, the lengths, the block
    size, the mask's trace or its captured tensors differ from an entry's."""
    tiles = (*tiles, *[None] * (4 - len(tiles)))
    traced = mask.traced
    key = (*(None if t is None else (t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device) for t in tiles),
           tuple(seq_lengths), tuple(block_size), id(traced), traced.stamps())
    found = CONVERTED.get(key)
    if found is not None:
        return found[1]
    bm = BlockMap.from_flex_tiles(*tiles, seq_lengths=seq_lengths, block_size=block_size, mask_mod=mask,
                                  tile_size=kernel_tiles_of(block_size, "block_mask BLOCK_SIZE"))
    CONVERTED.put(key, (tiles, bm))
    return bm


def converted_block_mask(block_mask: BlockMask) -> BlockMap:
    """The BlockMap of a torch BlockMask with its own mask_mod (traced here), found again as
    `converted` finds it."""
    tiles = [getattr(block_mask, name) for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                    "full_kv_indices")]
    return converted(tiles, block_mask.seq_lengths, block_mask.BLOCK_SIZE, as_mask_mod(block_mask.mask_mod))


def _inputs(mask_name, score_name, map_handle, q, k, v):
    """The mods and map an operator names (a mod by its handle or key), and k and v over q's
    batch (views where shared)."""
    mask, score = _found(mask_name, _mod_named), _found(score_name, _mod_named)
    block_map = _found(map_handle, BlockMap.of_handle, "block map")
    if k.shape[0] != q.shape[0]:
        k, v = k.expand(q.shape[0], -1, -1, -1), v.expand(q.shape[0], -1, -1, -1)
    return mask, score, block_map, k, v


def _refuse_captured_gradients(*mods) -> None:
    """The operators' autograd has no inputs for the mods' captured tensors, so a gradient they
    need would be silently missing: refuse a mod whose captured tensor needs one where autograd
    records the call (setup_context, which runs with grad mode off)."""
    for mod in mods:
        if mod is not None and captured_needing_grad(mod.traced, recording=True):
            raise _captured_gradient_error(mod)


def _refuse_traced_captured_gradients(*mods) -> None:
    """_refuse_captured_gradients for code Dynamo traces: it reads what the mods' latest traces
    recorded (re-checking their guards would run maskc's tracer under Dynamo)."""
    for mod in mods:
        if captured_need_grad_for_dynamo(mod):
            raise _captured_gradient_error(mod)


def _captured_gradient_error(mod) -> NotImplementedError:
    return NotImplementedError(f"{mod.kind} '{mod.__name__}' captures a tensor that requires grad; under "
                               f"torch.compile maskc does not compute gradients of captured tensors yet (eager "
                               f"calls do): detach it inside the compiled code, or call maskc eagerly")


# The structures (the mods' trace signatures) maskc::attention has run, up to the count that
# warns: the graph runs any mod, so a mod of a new structure costs only what it costs eagerly (a
# trace, and a kernel the first time), which a loop making one each step pays every step.
_STRUCTURES: set = set()
_STRUCTURES_WARNED = 8
state.register(__name__, "_STRUCTURES", "the mod structures the torch.compile operator has run, to warn once where "
               "a loop makes a new one each step", f"at most {_STRUCTURES_WARNED} signatures",
               size=lambda: len(_STRUCTURES), clear=_STRUCTURES.clear)


def _note_structure(mask, score) -> None:
    """Warn once where the operator has run as many mod structures as Dynamo's recompile limit
    allows graphs by default: a step that builds its mod from a new function body each time."""
    if len(_STRUCTURES) >= _STRUCTURES_WARNED:
        return
    _STRUCTURES.add(tuple(None if mod is None else mod.signature for mod in (mask, score)))
    if len(_STRUCTURES) == _STRUCTURES_WARNED:
        latest = mask if mask is not None else score
        warnings.warn(f"maskc under torch.compile has run mods of {_STRUCTURES_WARNED} different structures, the "
                      f"latest {latest.kind} '{latest.__name__}' ({latest.expr}): a mod whose expression changes costs "
                      f"a trace and, for each new structure, a kernel compile (seconds on a GPU), every step it "
                      f"changes; build the mod once outside the step and change only the values it captures (a "
                      f"window, a tensor)", stacklevel=2)


def _mod_named(name):
    """The mod of a handle (a tensor) or a key (a string)."""
    return mod_of_key(name) if isinstance(name, str) else mod_of_handle(name)


def _token(problem) -> int:
    with _lock:
        token = _serials.get(problem)
        if token is None:
            token = _serials[problem] = next(_counter)
    _forwards.put(token, problem)
    return token


def _found(name, find, what: str = "mod"):
    """What `find` gives for a name (a handle or key; None or "" name nothing), or an error
    naming the rule where it no longer lives."""
    if name is None or (isinstance(name, str) and not name):
        return None
    found = find(name)
    if found is None:
        name = f"{what} #{int(name)}" if isinstance(name, torch.Tensor) else f"'{name}'"
        raise RuntimeError(f"maskc::attention names {name}, which no longer lives in this process (or never did): "
                           f"the operator is recorded by compiled_attention under torch.compile for mods and maps "
                           f"that the compiled code keeps alive, not called directly")
    return found


# -- decoding --------------------------------------------------------------------------------
def decode(q, k, v, kv_lens, mask_mod, score_mod, scale, enable_gqa: bool, block_map):
    """(out, lse) of compiled_attention with kv_lens through `maskc::decode`, as `attention`;
    through `maskc::decode_replayable` where the call's plan depends on its shapes alone (no
    block map, mods that capture nothing), which CUDA graphs may then record."""
    mask_mod = plan.mask_of_call(mask_mod, block_map)
    keys = (_key(mask_mod, MaskMod, "mask_mod"), _key(score_mod, ScoreMod, "score_mod"))
    _refuse_traced_captured_gradients(mask_mod, score_mod)  # decoding has no gradients at all
    scale = None if scale is None else float(scale)
    if block_map is None and all(mod is None or mod.captures_nothing for mod in (mask_mod, score_mod)):
        return torch.ops.maskc.decode_replayable(q, k, v, kv_lens, *keys, scale, enable_gqa)
    return torch.ops.maskc.decode(q, k, v, kv_lens, *keys, block_map.handle if block_map is not None else None,
                                  scale, enable_gqa)


def paged(q, k_pages, v_pages, page_table, lens, seq_ids, page_size: int, mask_mod, score_mod, scale,
          enable_gqa: bool):
    """(out, lse) of paged_attention through `maskc::paged_attention`: the cache's tensors are
    the operator's inputs, so a step reads the cache's state when it runs."""
    keys = (_key(mask_mod, MaskMod, "mask_mod"), _key(score_mod, ScoreMod, "score_mod"))
    return torch.ops.maskc.paged_attention(q, k_pages, v_pages, page_table, lens, seq_ids, page_size, *keys,
                                           None if scale is None else float(scale), enable_gqa)


@torch.library.custom_op("maskc::decode", mutates_args=(), **_PYTHON_EACH_CALL)
def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor, mask_key: str, score_key: str,
            map_handle: torch.Tensor | None, scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask, score, block_map, k, v = _inputs(mask_key, score_key, map_handle, q, k, v)
    if dispatch.family(q, k, False, block_map, kv_lens) == dispatch.NO_PAIRS:
        return launch.no_pairs(q, v)
    return decoding.contiguous(q, k, v, mask, score, scale, kv_lens, block_map)


@_decode.register_fake
def _decode_fake(q, k, v, kv_lens, mask_key, score_key, map_handle, scale, enable_gqa):
    plan.check_tensors(q, k, v, enable_gqa)
    decoding.check_lens(kv_lens, q, k)
    return launch.outputs(q, v.shape[3])


@torch.library.custom_op("maskc::decode_replayable", mutates_args=())
def _decode_replayable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor, mask_key: str,
                       score_key: str, scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask, score, _, k, v = _inputs(mask_key, score_key, None, q, k, v)
    if dispatch.family(q, k, False, None, kv_lens) == dispatch.NO_PAIRS:
        return launch.no_pairs(q, v)
    return decoding.replayable(q, k, v, mask, score, scale, kv_lens)


@_decode_replayable.register_fake
def _decode_replayable_fake(q, k, v, kv_lens, mask_key, score_key, scale, enable_gqa):
    return _decode_fake(q, k, v, kv_lens, mask_key, score_key, None, scale, enable_gqa)


@torch.library.custom_op("maskc::paged_attention", mutates_args=(), **_PYTHON_EACH_CALL)
def _paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
           lens: torch.Tensor, seq_ids: torch.Tensor, page_size: int, mask_key: str, score_key: str,
           scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mask, score = _found(mask_key, mod_of_key), _found(score_key, mod_of_key)
    return decoding.paged(q, k_pages, v_pages, page_table, lens, seq_ids, page_size, mask, score, scale, enable_gqa)


@_paged.register_fake
def _paged_fake(q, k_pages, v_pages, page_table, lens, seq_ids, page_size, mask_key, score_key, scale, enable_gqa):
    decoding.check_slots(seq_ids, q, page_table.shape[0])
    return launch.outputs(q, v_pages.shape[3])


# -- backward --------------------------------------------------------------------------------
@torch.library.custom_op("maskc::attention_backward", mutates_args=(), **_PYTHON_EACH_CALL)
def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              token: torch.Tensor, d_out: torch.Tensor | None, d_lse: torch.Tensor | None,
              seed: torch.Tensor | None, keep_min: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    token = int(token)
    if token == _NO_PAIRS:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if token == _NO_BACKWARD:
        # the graph was traced without gradients (differentiable=False) and replayed with them
        raise MaskcError("maskc's backward under torch.compile reached a forward traced without gradients, which "
                         "ran the decoding kernel and kept no plan; call the compiled function with the gradient "
                         "mode and requires_grad it was compiled with (torch.compile recompiles on a change)")
    problem = _forwards.get(token)
    if problem is None:
        raise MaskcError(f"maskc's backward under torch.compile needs its forward's plan, held for the latest "
                         f"{_PENDING} forwards' backwards, and token {token}'s was dropped: {_PENDING} other "
                         f"forwards ran since, or maskc.clear_caches() ran; run the backward sooner after its "
                         f"forward, and clear the caches between steps, not within one")
    B = q.shape[0]
    shared = k.shape[0] != B
    batched = (k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) if shared else (k, v)
    dropout = None if seed is None else dropping.Dropout(seed, keep_min)
    dq, dk, dv = launch.backward(q, *batched, out, lse, d_out, d_lse, problem, dropout=dropout)
    if shared:  # k and v served every batch of q: their gradients sum over it
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return _like(dq, q), _like(dk, k), _like(dv, v)


def _like(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`grad` in the layout `_backward_fake` promises, torch.empty_like(t)'s: a compiled graph
    asserts it. The kernels' gradients are contiguous where their inputs are views (a model's
    [B, L, H, D] transposed; dQ summed in float32 by the Gluon kernel, dK and dV summed over a
    shared batch): Inductor's graph failed on a 1B Llama's step with a stride mismatch."""
    if grad.is_contiguous() and t.is_contiguous():
        return grad
    like = torch.empty_like(t)
    return grad if like.stride() == grad.stride() else like.copy_(grad)


@_backward.register_fake
def _backward_fake(q, k, v, out, lse, token, d_out, d_lse, seed, keep_min):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    # again where the graph records the backward: a mod may have been rebound since tracing
    # the mods' handles, where they are real: AOTAutograd records with fake ones, and the operator
    # checks again when it runs
    _refuse_captured_gradients(*(mod_of_handle(h) for h in inputs[3:5] if h is not None and not is_fake(h)))
    q, k, v = inputs[:3]
    ctx.n_tiles = len(inputs[8])  # flex_tiles' gradient is a list of as many Nones
    out, lse, token = output
    ctx.save_for_backward(q, k, v, out, lse, token, inputs[11])  # inputs[11]: the dropout's seed, or None
    ctx.keep_min = inputs[12]


def _grad(ctx, d_out, d_lse, _):
    refuse_second_derivatives()
    q, k, v, out, lse, token, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.maskc.attention_backward(q, k, v, out, lse, token, d_out, d_lse, seed, ctx.keep_min)
    return dq, dk, dv, None, None, None, None, None, [None] * ctx.n_tiles, None, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


__all__ = ["CONVERTED", "attention", "converted", "converted_block_mask", "decode", "paged"]
