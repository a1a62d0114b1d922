"""A Hugging Face transformers backend: attn_implementation="maskc".

>>> import maskc.integrations.transformers
>>> maskc.integrations.transformers.register()
>>> model = AutoModelForCausalLM.from_config(config, attn_implementation="maskc")

transformers describes each kind of layer's mask (causal, sliding window, chunked,
bidirectional, with padding and packed sequences folded in) as one FlexAttention-style mask
function, and asks the backend's mask function to turn it into whatever the attention layers
receive. maskc's turns it into a LayerMask: that function traced once per forward pass into a
MaskMod, at absolute positions, with padded keys dropped. Every layer of that kind runs the
same MaskMod, so only the first traces, analyses tiles and looks up kernels; the others reuse
its plan. Cache offsets and window sizes are captured numbers and padding, position ids and
document ids captured tensors: runtime values of one kernel, never a recompile, and nothing
is evaluated per (query, key) pair.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

import maskc
from maskc._graph import outside_graph


@dataclass(frozen=True)
class LayerMask:
    """What the layers of one kind receive as `attention_mask` for one forward pass.

    `mask_mod` sees query i as token q_offset + i of the sequence and key j as token
    kv_offset + j (the offsets of the KV cache), and drops padded keys.
    """

    mask_mod: maskc.MaskMod
    q_len: int
    kv_len: int
    # A decoding step: kv_lens [B] (int32, on the device) counts the tokens in the cache, this
    # step's included (a static cache's keys are the whole cache, past them too); mask_mod then
    # sees the positions that compiled_attention's kv_lens gives (query i at kv_lens - q_len + i),
    # so it captures no offset, and without padding its plan depends on shapes alone (CUDA
    # graphs replay it).
    kv_lens: torch.Tensor | None = None

    # With a static cache, generate() builds each step's masks ahead of the forward pass, calls
    # contiguous() on them and hands them to the model, whose mask preparation passes on a mask
    # that is not 2-d (a padding mask) to the mask function: layer_mask() returns it as it is.
    ndim = 4

    def contiguous(self) -> "LayerMask":
        return self

    # A model that works on the mask itself instead of handing it to its attention function
    # (bloom adds its ALiBi to it, xglm asks its size, doge its dtype) gets this, not a crash
    # in its own code (an AttributeError, so that hasattr() stays False).
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_READ_AS_TENSOR.format(f"its .{name}"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(_READ_AS_TENSOR.format(f"{getattr(func, '__name__', func)}() on it"))

    def _arithmetic(self, *_):
        # (a tensor's operators turn the TypeError of __torch_function__ into NotImplemented,
        # and Python then asks these)
        raise TypeError(_READ_AS_TENSOR.format("arithmetic on it"))

    def __getitem__(self, index):
        """The mask of the last queries only, `mask[:, :, -n:, :]`: Gemma 4's KV-shared layers
        keep the rows of the logits asked for (logits_to_keep). Any other index is refused."""
        full = slice(None)
        if isinstance(index, tuple) and len(index) == 4 and index[0] == index[1] == index[3] == full \
                and isinstance(index[2], slice) and index[2].stop is None and index[2].step in (None, 1) \
                and isinstance(index[2].start, (int, type(None))):
            rows = range(self.q_len)[index[2]]
            return _last_queries(self, rows.start, len(rows))
        raise TypeError(_READ_AS_TENSOR.format(f"indexing it with {index!r}"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _arithmetic
    __and__ = __rand__ = __or__ = __ror__ = __pow__ = __invert__ = __neg__ = _arithmetic


_READ_AS_TENSOR = ("this model works on its attention mask as a tensor ({}), but maskc's backend hands each layer "
                   "a traced mask that only maskc's attention function reads; use attn_implementation='sdpa' or "
                   "'eager' for this model")


def register(name: str = "maskc") -> str:
    """Register maskc with transformers under `name`: its attention function with
    AttentionInterface and its mask function with AttentionMaskInterface. Returns `name`.

    >>> maskc.integrations.transformers.register()
    'maskc'
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="maskc")
    """
    # Older releases call mask functions with cache_position instead: checked on transformers'
    # own SDPA mask function, which takes what every mask function is given
    if "q_offset" not in inspect.signature(sdpa_mask).parameters:
        raise ImportError(f"maskc's transformers backend needs mask functions called with q_length and q_offset "
                          f"(transformers 5.7 or later), got transformers {transformers.__version__}; upgrade it: "
                          f"pip install -U 'maskc[hf]'")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, layer_mask)
    return name


def layer_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0, *,
               mask_function, attention_mask: torch.Tensor | LayerMask | None = None, device=None,
               **kwargs) -> LayerMask:
    """transformers' mask interface for maskc: `mask_function` with the cache offsets and the
    2-d padding mask `attention_mask` (True: a real token) folded in, as one LayerMask.

    The other keywords transformers passes (config, dtype, device, local_size, the skip flags of
    the SDPA path) change nothing here: the mask function already holds the pattern.

    Under torch.compile this runs outside the graph (one graph break per forward pass, before
    the layers); the layers' graph receives the LayerMask.
    """
    if isinstance(attention_mask, LayerMask):  # built ahead by generate() for this step
        return attention_mask
    if _a_decoding_step(q_length, kv_length, q_offset, kv_offset, device):
        return _decoding_step(batch_size, q_length, kv_length, q_offset, mask_function, attention_mask, device)
    # a static cache gives the offset as a 0-d tensor (so that compiled graphs need not read it);
    # the trace needs a Python number, which becomes a kernel argument
    q_offset = int(q_offset)
    padding = None
    if attention_mask is not None:
        # keys past the end of the mask (a static cache's empty slots) are padding too
        padding = F.pad(attention_mask, (0, max(0, kv_offset + kv_length - attention_mask.shape[-1])))
        if bool(padding.all()):  # no padded key: no captured tensor for the tiles to read
            padding = None
    return LayerMask(_StepMask.of(mask_function, padding, q_offset, kv_offset), q_length, kv_length)


# The longest query of a decoding step that layer_mask() hands to the decoding path (kv_lens);
# a prefill keeps its offsets and the prefill kernel.
_STEP_QUERIES = 8


def _a_decoding_step(q_length: int, kv_length: int, q_offset, kv_offset, device) -> bool:
    """Whether layer_mask() may give this call kv_lens = q_offset + q_length: a few queries
    without gradients (kv_lens is for decoding) over keys from position 0 that are the
    sequence's own. With a number offset that holds where q_offset + q_length == kv_length, and
    kv_lens then cuts no key: the same mask as the offsets give. A static cache's offset (a
    0-d tensor) cannot be compared without waiting for the GPU, and its keys run past the step
    (the cache's empty slots, which kv_lens cuts): there it serves the masks of the sequence's
    own cache, not a bidirectional mask (an encoder's, or cross-attention to one), whose keys
    are not the sequence's positions."""
    if kv_offset != 0 or q_length > _STEP_QUERIES or torch.is_grad_enabled():
        return False
    if isinstance(q_offset, torch.Tensor):
        return not _built_by(_BIDIRECTIONAL_BUILDERS)
    return device is not None and q_offset > 0 and q_offset + q_length == kv_length


# transformers' builders of masks whose keys need not be the query's sequence
_BIDIRECTIONAL_BUILDERS = frozenset({"create_bidirectional_mask", "create_bidirectional_sliding_window_mask"})


def _built_by(names: frozenset) -> bool:
    """Whether a function of transformers.masking_utils named in `names` is building this mask."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in names and frame.f_globals.get("__name__") == "transformers.masking_utils":
            return True
        frame = frame.f_back
    return False


def _decoding_step(batch_size: int, q_length: int, kv_length: int, q_offset, mask_function, attention_mask,
                   device) -> LayerMask:
    """The LayerMask of a decoding step over keys that start at position 0: its offset becomes
    the step's kv_lens (q_offset + q_length for every sequence), so the mask captures no number
    that changes every step and the step's plan is found again, not rebuilt. A static cache's
    offset (a 0-d tensor) stays on the device, and reading it waits for nothing. Padded keys
    (zeros in a 2-d attention_mask) stay a captured tensor; a static cache's slots past the
    mask are left to kv_lens."""
    padding = None
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = F.pad(attention_mask, (0, max(0, kv_length - attention_mask.shape[-1])), value=1).bool()
    if isinstance(q_offset, torch.Tensor):
        lens = (q_offset.reshape(1) + q_length).to(torch.int32).repeat(batch_size)
    else:
        lens = torch.full((batch_size,), q_offset + q_length, dtype=torch.int32, device=device)
    return LayerMask(_StepMask.of(mask_function, padding, 0, 0, at_lens=True), q_length, kv_length, lens)


# (torch.compiler.disable's decorator takes reason= from torch 2.8 only: outside_graph decides)
_TRACED_IN_PYTHON = "maskc traces the model's mask function in Python, once per forward pass"
layer_mask = outside_graph(layer_mask, _TRACED_IN_PYTHON)


def _last_queries(mask: LayerMask, first: int, n: int) -> LayerMask:
    """`mask` for its queries first .. first + n - 1: the same mask function, padding and keys,
    the queries' offset moved on (a MaskMod of its own, as any mask built elsewhere)."""
    if mask.kv_lens is not None:  # the last n queries sit at kv_lens - n + i: the same mask
        return LayerMask(mask.mask_mod, n, mask.kv_len, mask.kv_lens)
    step = mask.mask_mod.fn
    return LayerMask(_StepMask.of(step.mask_function, step.padding, step.q_offset + first, step.kv_offset), n,
                     mask.kv_len)


_last_queries = outside_graph(_last_queries, _TRACED_IN_PYTHON)
_decoding_step = outside_graph(_decoding_step, _TRACED_IN_PYTHON)


class _StepMask:
    """The mask of one kind of layer in one forward pass: the model's mask function at the cache
    offsets, with padded keys dropped.

    transformers makes its mask functions anew on every forward pass. One _StepMask, and its
    MaskMod, serves every pass whose mask function has the same structure (the same code,
    composed the same way) and is built at the same place of the model's code: each pass
    rebinds the function, offsets and padding, which maskc's trace guards re-read, so the kernel
    and the MaskMod stay and only the values change. A compiled graph, which names the MaskMod,
    then runs again instead of recompiling each pass. The place keeps apart the masks one pass
    builds before its layers read them: Blip-2's Q-Former builds its self-attention mask and then
    its cross-attention mask, both bidirectional with padding, and with one _StepMask for both
    its self-attention had read the image's padding.
    """

    _interned = threading.local()

    def __init__(self, mask_function, padding, q_offset: int, kv_offset: int):
        self.mask_function, self.padding = mask_function, padding
        self.q_offset, self.kv_offset = q_offset, kv_offset

    @classmethod
    def of(cls, mask_function, padding, q_offset: int, kv_offset: int, at_lens: bool = False) -> maskc.MaskMod:
        """The MaskMod of this structure and place, rebound to these values; `at_lens`: for a call
        with kv_lens, whose positions carry the offsets (_AtLens)."""
        table = cls._interned.__dict__.setdefault("table", {})
        key = (_structure(mask_function), padding is None, at_lens, _call_site())
        found = table.get(key)
        if found is None:
            made = (_AtLens if at_lens else cls)(mask_function, padding, q_offset, kv_offset)
            found = table[key] = maskc.MaskMod(made, name="transformers_mask")
        else:
            step = found.fn
            step.mask_function, step.padding, step.q_offset, step.kv_offset = (mask_function, padding, q_offset,
                                                                               kv_offset)
        return found

    def __call__(self, b, h, q_idx, kv_idx):
        kv = kv_idx + self.kv_offset
        kept = self.mask_function(b, h, q_idx + self.q_offset, kv)
        return kept if self.padding is None else kept & self.padding[b, kv]


class _AtLens(_StepMask):
    """A _StepMask read at the positions kv_lens gives: it adds no offset, so that its trace
    captures no number (and, without padding, nothing at all)."""

    def __call__(self, b, h, q_idx, kv_idx):
        kept = self.mask_function(b, h, q_idx, kv_idx)
        return kept if self.padding is None else kept & self.padding[b, kv_idx]


def _call_site() -> tuple:
    """Where the model asked for this mask: the code and instruction of the first caller outside
    transformers' mask building and its decorators (transformers.utils: deprecated keywords),
    maskc and torch (Dynamo's frames under torch.compile); the same on every forward pass,
    different for each mask a pass builds."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_MASK_BUILDERS):
        frame = frame.f_back
    return (frame.f_code, frame.f_lasti) if frame is not None else ()


# module names, matched as prefixes: dotted, so that a package such as torchtune is not skipped
_MASK_BUILDERS = ("maskc.", "transformers.masking_utils", "transformers.utils.", "torch.")


def _structure(fn) -> tuple:
    """What a mask function computes, less the tensors it captures: its code, the numbers it
    closes over (a window size) and, recursively, the functions it closes over (and_masks'
    tuple of them). Two kinds of layer whose masks differ only in a number (two window sizes)
    get two _StepMasks, so building one kind's mask never rebinds another's in the same pass."""
    if isinstance(fn, (tuple, list)):
        return tuple(_structure(f) for f in fn)
    if isinstance(fn, functools.partial):
        return ("partial", _structure(fn.func), *(_structure(a) for a in fn.args),
                *((k, _structure(a)) for k, a in sorted(fn.keywords.items())))
    if isinstance(fn, (int, float, bool, str, type(None))):
        return (type(fn), fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return (type(fn),)  # a tensor, or a callable object: compared by the trace's guards
    return (code, *(_structure(_contents(c)) for c in fn.__closure__ or ()))


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: a name the function reads, bound after it was made
        return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for maskc: query [B, Hq, Lq, D], key and value
    [B, Hkv, Lkv, D] (grouped-query attention when Hkv < Hq) with the LayerMask of layer_mask();
    returns (output [B, Lq, Hq, Dv], None): maskc never forms the attention weights.
    `softcap` (Gemma 2's attn_logit_softcapping) becomes a score_mod, and `s_aux` (gpt-oss's
    sinks parameter, one logit per query head) maskc's sinks. `dropout` (transformers passes
    the model's attention_dropout while training and 0.0 in eval mode) becomes
    compiled_attention's dropout_p, drawn from torch's default generator, so torch.manual_seed
    reproduces a training step. `sliding_window` is already in the LayerMask (it is read only
    where a layer gets no mask); the flash-attention keywords (cu_seq_lens, position_ids) are
    ignored.
    """
    for name, what in (("position_bias", "a position bias tensor (T5-style)"),
                       ("cache", "a paged cache (continuous batching)")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"maskc attention does not take {what} yet, got {name}; use "
                                      f"attn_implementation='eager' or 'sdpa' for this model")
    kv_lens = attention_mask.kv_lens if isinstance(attention_mask, LayerMask) else None
    if dropout and kv_lens is not None:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} drops attention (dropout={dropout}, the model's "
                         f"attention_dropout in training mode) in a decoding step over a cache, which maskc runs "
                         f"without dropout; call model.eval() before generate(), or set config.attention_dropout = 0.0")
    out = maskc.compiled_attention(query, key, value, mask_mod=_mask_mod(module, attention_mask, query, key, kwargs),
                                   score_mod=_softcap(softcap) if softcap else None, scale=scaling,
                                   enable_gqa=query.shape[1] != key.shape[1], sinks=kwargs.get("s_aux"),
                                   kv_lens=kv_lens, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def _mask_mod(module, attention_mask, query, key, kwargs) -> maskc.MaskMod | None:
    q_len, kv_len = query.shape[2], key.shape[2]
    if isinstance(attention_mask, LayerMask):
        if (attention_mask.q_len, attention_mask.kv_len) != (q_len, kv_len):
            raise ValueError(f"the mask was built for {attention_mask.q_len} queries and {attention_mask.kv_len} keys "
                             f"but layer {getattr(module, 'layer_idx', '?')} has {q_len} and {kv_len}; the model "
                             f"changes its keys after building the mask, which maskc's mask cannot follow: use "
                             f"attn_implementation='sdpa' for it")
        return attention_mask.mask_mod
    if attention_mask is None:
        # no mask was built for this call (a module used on its own, or a model that passes none)
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        return _causal_from(kv_len - q_len, kwargs.get("sliding_window")) if is_causal else None
    got = (f"a {attention_mask.dim()}-d {attention_mask.dtype} tensor" if isinstance(attention_mask, torch.Tensor)
           else type(attention_mask).__name__)
    raise TypeError(f"maskc attention takes the mask that maskc's mask function builds, got {got} (a mask "
                    f"prepared outside the model's mask functions); pass a 2-d attention_mask for padding or "
                    f"position_ids for packed sequences, or use attn_implementation='sdpa' for custom 4-d masks")


@functools.lru_cache(maxsize=64)
def _causal_from(offset: int, window: int | None) -> maskc.MaskMod:
    """Causal with the queries at the end of the keys (query i is key offset + i), within the
    last `window` keys when given (transformers' sliding_window); traced once per value pair."""
    if window is None:
        def causal_after_cache(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
    else:
        def causal_after_cache(b, h, q_idx, kv_idx):
            return (q_idx + offset >= kv_idx) & (q_idx + offset - kv_idx < window)
    return maskc.MaskMod(causal_after_cache)


@functools.lru_cache(maxsize=16)
def _softcap(cap: float) -> maskc.ScoreMod:
    """One ScoreMod per cap, so that each layer's call does not trace it again."""
    return maskc.scores.softcap(cap)


__all__ = ["LayerMask", "attention_forward", "layer_mask", "register"]
