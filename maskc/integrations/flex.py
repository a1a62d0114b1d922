"""FlexAttention's API on maskc's kernels: swapping
`from torch.nn.attention.flex_attention import flex_attention, create_block_mask` for
`from maskc import flex_attention, create_block_mask` runs the same code.

>>> from maskc import create_block_mask, flex_attention
>>> block_mask = create_block_mask(causal, None, None, 4096, 4096, device="cuda")
>>> out = flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask)

A BlockMask (made here, by torch, or by hand) is read as FlexAttention reads it: its tiles
decide which blocks run and which run without the mask, its mask_mod (traced by maskc) decides
the pairs of the others.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.attention.flex_attention as torch_flex

from maskc._graph import outside_graph
from maskc.analysis import BlockMap, block_map
from maskc.analysis.build import IN_PYTHON as ANALYSED_IN_PYTHON
from maskc.masks import and_masks, or_masks
from maskc.runtime import compiled_attention, ops, state
from maskc.runtime.api import CAPTURED_GRADIENTS, PLAIN_FUNCTION, plain_block_mask, plain_function
from maskc.runtime.tiles import kernel_tiles_of
from maskc.trace import MaskMod
from maskc.trace.mods import captured_need_grad_for_dynamo

_log = logging.getLogger(__name__)

# Torch's own: maskc.create_block_mask returns torch BlockMasks, so that code printing one,
# calling .to_dense() or handing it to torch's flex_attention keeps working.
BlockMask = torch_flex.BlockMask
# Dense evaluation of a mod on every pair, exactly as FlexAttention defines the mask (for tests
# and pictures; maskc's kernels never need it).
create_mask = torch_flex.create_mask
noop_mask = MaskMod(torch_flex.noop_mask, name="noop_mask")

# torch's own types of return_aux and kernel_options, so that a file whose import line names
# them runs after the swap; looked up when asked for (module __getattr__), as torch before 2.9
# has none of them.
TORCH_TYPES = ("AuxOutput", "AuxRequest", "FlexKernelOptions")

_NO_OP_BLOCK = 1 << 30  # torch's _LARGE_SPARSE_BLOCK_SIZE
# kernel_options key sets already reported as ignored, so the log says it once.
_IGNORED_REPORTED = state.lru(__name__, "_IGNORED_REPORTED", "the kernel_options key sets logged as ignored", 64)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch's flex_attention on maskc's kernels: same arguments, same results.

    Returns out [B, Hq, Lq, Dv] in q's dtype; with return_lse=True (out, lse), with
    return_aux=AuxRequest(lse=True) (out, AuxOutput(lse=lse)): lse [B, Hq, Lq] in natural log,
    float32 (float64 for float64 inputs), -inf on rows with no kept key (whose out is 0), as
    torch returns it. `block_mask` is a torch BlockMask (converted once and remembered while its
    tiles stay as they are, eager and compiled calls alike) or a maskc BlockMap. kernel_options
    are FlexAttention's kernel knobs: maskc chooses its own tiles and ignores them.
    Differentiable, on CUDA and on CPU (interpreted).

    >>> block_mask = maskc.create_block_mask(causal, None, None, 2048, 2048, device="cuda")
    >>> out, lse = maskc.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    """
    if return_lse and return_aux is not None:
        raise ValueError("flex_attention takes return_lse or return_aux, not both; pass "
                         "return_aux=AuxRequest(lse=True) alone")
    if return_aux is not None and return_aux.max_scores:
        raise NotImplementedError("maskc's kernels do not return max_scores; ask for "
                                  "return_aux=AuxRequest(lse=True) only")
    _ignore(kernel_options)
    if torch.compiler.is_compiling() and (plain_function(None, score_mod) or _plain_mask_mod(block_mask)):
        # here, not in compiled_attention: outside the graph, a torch BlockMask is converted below
        return _flex_attention_outside_graph(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                             kernel_options, return_aux=return_aux)
    if torch.compiler.is_compiling() and captured_need_grad_for_dynamo(score_mod):
        return _flex_attention_for_gradients(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                             kernel_options, return_aux=return_aux)
    mask = bm = None
    if _no_op(block_mask):
        mask = None if block_mask.mask_mod is torch_flex.noop_mask else block_mask.mask_mod
    elif torch.compiler.is_compiling() and isinstance(block_mask, BlockMask):
        bm = block_mask  # its tile tensors are the operator's inputs, converted when it runs (runtime/ops.py)
    elif block_mask is not None:
        bm = block_mask if isinstance(block_mask, BlockMap) else converted(block_mask)
        _check_fits(bm, query, key)
        mask = bm.mask_mod
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    result = compiled_attention(query, key, value, mask_mod=mask, score_mod=score_mod, scale=scale,
                                enable_gqa=enable_gqa, return_lse=want_lse, block_map=bm)
    if return_aux is None:
        return result
    out, lse = result if want_lse else (result, None)
    # NOTE: looked up here, not imported: AuxOutput came with torch 2.9, and maskc supports
    # older torch, whose callers cannot pass return_aux.
    return out, torch_flex.AuxOutput(lse=lse, max_scores=None)


_flex_attention_outside_graph = outside_graph(flex_attention, PLAIN_FUNCTION)
_flex_attention_for_gradients = outside_graph(flex_attention, CAPTURED_GRADIENTS)


def _no_op(block_mask) -> bool:
    """Whether `block_mask` is torch's no-op BlockMask (_create_empty_block_mask: one block over
    any lengths, made for lengths (1, 1), which torch's flex_attention does not check): its
    mask_mod alone applies."""
    return isinstance(block_mask, BlockMask) and tuple(block_mask.BLOCK_SIZE) == (_NO_OP_BLOCK, _NO_OP_BLOCK)


def _plain_mask_mod(block_mask) -> bool:
    """compiled_attention's plain_block_mask, but for the no-op BlockMask, whose mask_mod is
    passed on as mask_mod, where compiled_attention decides."""
    return not _no_op(block_mask) and plain_block_mask(block_mask)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks=True, compute_dq_write_order=False, dq_kv_order=True):
    """torch's create_block_mask, by maskc's analysis instead of evaluating every pair: the
    torch BlockMask of `mask_mod` at these lengths, with tiles of BLOCK_SIZE (an int or
    (q, kv), multiples of 16: maskc's kernels read each block as the power-of-two tiles inside
    it, so (128, 112) runs as torch runs it). B or H None: one row for every batch or head, as
    torch makes it.

    maskc's analysis needs no compilation (`_compile` has no effect) and its backward is
    deterministic by construction (`compute_dq_write_order` and `dq_kv_order`, which prepare
    torch's FLASH backend for that, have none either).

    >>> block_mask = maskc.create_block_mask(causal, None, None, 131072, 131072, device="cuda")
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H = (1 if n is None else n for n in (B, H))
    kernel_tiles_of(BLOCK_SIZE)  # refused here, where it is given, rather than at the first call
    analysed = block_map(mask_mod, Q_LEN, KV_LEN, block_size=BLOCK_SIZE, B=B, H=H, device=device)
    return analysed.to_flex_block_mask(B, H, separate_full_blocks=separate_full_blocks)


# torchtitan and vLLM call torch.compile(create_block_mask): the analysis runs outside the graph
create_block_mask = outside_graph(create_block_mask, ANALYSED_IN_PYTHON)


def converted(block_mask) -> BlockMap:
    """The BlockMap of a torch BlockMask (BlockMap.from_flex_block_mask), from the conversions
    the torch.compile operator finds too (maskc.runtime.ops.converted): converted again only
    when its tile tensors, its mask_mod's trace or that trace's captured tensors changed."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask from create_block_mask (maskc's or torch's) or a "
                        f"maskc.BlockMap, got {type(block_mask).__name__}")
    return ops.converted_block_mask(block_mask)


def _check_fits(bm: BlockMap, query, key) -> None:
    """The BlockMask's lengths, said in FlexAttention's words (compiled_attention checks the
    rest; a converted BlockMask's block size is checked where it is converted)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
        return  # compiled_attention says what is wrong with them
    lengths = (query.shape[2], key.shape[2])
    if (bm.q_len, bm.kv_len) != lengths:
        raise ValueError(f"block_mask was created for Q_LEN={bm.q_len}, KV_LEN={bm.kv_len} but the inputs have "
                         f"q_len={lengths[0]}, kv_len={lengths[1]}; create it with create_block_mask(mask_mod, "
                         f"B, H, {lengths[0]}, {lengths[1]})")


def _ignore(kernel_options) -> None:
    if kernel_options is None:
        return
    if not isinstance(kernel_options, Mapping):
        raise TypeError(f"kernel_options must be a dict of FlexAttention kernel options or None, got "
                        f"{type(kernel_options).__name__}")
    keys = tuple(sorted(kernel_options))
    if keys and _IGNORED_REPORTED.get(keys) is None:
        _IGNORED_REPORTED.put(keys, True)
        _log.info("flex_attention ignores kernel_options %s: FlexAttention's kernel knobs; maskc chooses its own "
                  "tiles", ", ".join(keys))


def __getattr__(name: str):
    if name in TORCH_TYPES and hasattr(torch_flex, name):
        return getattr(torch_flex, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlockMask", "and_masks", "create_block_mask", "create_mask", "flex_attention", "noop_mask", "or_masks"]
