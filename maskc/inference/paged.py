"""maskc.PagedKVCache: a paged KV cache whose appends take their pages on the device.

The layout, which the paged attention kernel reads:
    k_pages [num_pages, page_size, Hkv, D], v_pages [num_pages, page_size, Hkv, Dv]
    page_table int32 [max_seqs, max_pages_per_seq]: slot s's token at position p lies in row
        p % page_size of page page_table[s, p // page_size]; entries past its pages are undefined
    lens int32 [max_seqs]: the tokens each slot holds

The free pages are a stack on the device. append() and free() each launch one Triton kernel
(maskc/inference/_cache_kernels.py) that finds and returns pages itself, so neither waits for the
device and both can be captured in a CUDA graph. A call the kernel refuses (out of pages, a
slot over its capacity, a bad slot) changes nothing and is recorded on the device; check()
reads the record and raises.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch
import triton

from maskc.errors import MaskcError
from maskc.runtime import loader, plan, state
from maskc.runtime.kernel import _Interpreted

_KERNELS_FILE = Path(__file__).with_name("_cache_kernels.py")
_MODULES: dict = {}  # {interpreted: the loaded kernels module}
_LOCK = threading.Lock()
_INT32_MAX = 2**31 - 1
# NOTE: CUDA's grid has at most 65535 blocks along its second axis, which holds the batch; the
# token chunks take the first, which has 2**31 - 1.
_MAX_BATCH = 65535
# Elements an append program copies per tensor (16 KB in bf16): a few thousand programs for a
# long prefill keep the copy at bandwidth, and a T=1 append runs one small program per slot.
_TILE = 8192
# Page ids free() moves per step of its loop over a slot's pages.
_FREE_BLOCK = 1024


def _forget_kernels() -> None:
    with _LOCK:
        _MODULES.clear()


state.register(__name__, "_MODULES", "PagedKVCache's loaded append kernels", "two entries: compiled and interpreted",
               size=lambda: len(_MODULES), clear=_forget_kernels, maxsize=2)


class CacheFullError(MaskcError, RuntimeError):
    """An append needed more pages than were free, or more tokens than a slot can hold."""


# A slot's default capacity in tokens. Attention over the cache builds its mask's block map over
# capacity × capacity positions once per mask (maskc/inference/decode.py), so a capacity of a
# whole large pool by default would cost seconds and gigabytes on the first call; pass
# max_pages_per_seq for longer sequences.
DEFAULT_CAPACITY = 131072


class PagedKVCache:
    """A paged KV cache for `max_seqs` sequences (slots) sharing `num_pages` pages, each slot
    holding up to max_pages_per_seq pages (default: 131072 tokens' worth, or every page).

    append() writes new tokens after each slot's current length, taking the pages it needs
    from a free stack on the device, without waiting for the device; free() gives a slot's
    pages back. A batch that does not fit stores nothing and raises (at once by default, else
    at the next check()). append() and free() can be captured in a CUDA graph; check() runs
    outside it.

    >>> cache = maskc.PagedKVCache(1024, 16, 8, 128, max_seqs=32, device="cuda")
    >>> cache.append(torch.tensor([0, 1], device="cuda"), k, v)   # k [2, 8, T, 128], v alike
    >>> cache.k_pages, cache.v_pages, cache.page_table, cache.lens  # what attention reads
    >>> cache.free(torch.tensor([0], device="cuda"))                # slot 0 is empty again
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_seqs: int, max_pages_per_seq: int | None = None,
                 head_dim_v: int | None = None):
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("head_dim_v", head_dim if head_dim_v is None else head_dim_v)):
            _check_positive(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}; pass e.g. torch.bfloat16")
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"PagedKVCache runs on CUDA (compiled) or CPU (interpreted), got device {device}")
        max_pages_per_seq = _check_layout(num_pages, page_size, max_seqs, max_pages_per_seq)
        shape = (num_pages, page_size, num_kv_heads)
        k_pages = torch.empty(*shape, head_dim, dtype=dtype, device=device)
        v_pages = torch.empty(*shape, head_dim_v or head_dim, dtype=dtype, device=device)
        self._adopt(k_pages, v_pages, max_seqs, max_pages_per_seq)

    def _adopt(self, k_pages: torch.Tensor, v_pages: torch.Tensor, max_seqs: int, max_pages_per_seq: int):
        """Takes checked pages and sizes; every slot empty and every page free."""
        self.k_pages, self.v_pages = k_pages, v_pages
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = k_pages.shape
        self.head_dim_v = v_pages.shape[3]
        self.dtype, self.device = k_pages.dtype, k_pages.device
        self.max_seqs, self.max_pages_per_seq = max_seqs, max_pages_per_seq
        self.capacity = max_pages_per_seq * self.page_size
        int32 = dict(dtype=torch.int32, device=self.device)
        # zeros, not empty: an entry past a slot's pages is undefined but names a real page, so a
        # kernel that reads one by mistake stays in bounds
        self.page_table = torch.zeros(max_seqs, self.max_pages_per_seq, **int32)
        self.lens = torch.zeros(max_seqs, **int32)
        # the stack pops from its top, so a fresh cache hands out pages 0, 1, 2, ...
        self._free = torch.arange(self.num_pages - 1, -1, -1, **int32)
        self._top = torch.full((1,), self.num_pages, **int32)
        self._counter = torch.zeros(1, **int32)
        self._marks = torch.zeros(max_seqs, **int32)
        self._status = torch.zeros(6, dtype=torch.int64, device=self.device)

    @classmethod
    def from_csr(cls, k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                 last_page_len: torch.Tensor, *, max_pages_per_seq: int | None = None) -> PagedKVCache:
        """A cache over FlashInfer's paged layout: sequence b holds pages indices[indptr[b]:indptr[b+1]],
        the last of them filled to last_page_len[b] (ignored for a sequence with no pages), and
        becomes slot b of B = len(indptr) - 1. The pages are shared, not copied; the ones no sequence
        references are free. Reads the table once (a sync).

        >>> cache = maskc.PagedKVCache.from_csr(k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len)
        """
        _check_pages(k_pages, v_pages)
        P, num_pages = k_pages.shape[1], k_pages.shape[0]
        indptr, indices, last_page_len = (
            plan.index_argument(name, t, what="a 1-d integer tensor", fix=f"pass FlashInfer's kv_{name} (int32)",
                                device=k_pages.device, owner="k_pages")
            for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)))
        B = indptr.shape[0] - 1
        if B < 1 or last_page_len.shape[0] != B:
            raise ValueError(f"indptr must have B + 1 entries and last_page_len B, for B >= 1 sequences; got "
                             f"{indptr.shape[0]} and {last_page_len.shape[0]}")
        table = torch.cat([indptr.long(), last_page_len.long(), indices.long()]).cpu()  # the one sync
        indptr, last, indices = table[:B + 1], table[B + 1:2 * B + 1], table[2 * B + 1:]
        counts = indptr[1:] - indptr[:-1]
        if indptr[0] != 0 or (counts < 0).any() or indptr[-1] > indices.shape[0]:
            raise ValueError(f"indptr must start at 0, never decrease and end at most at len(indices) "
                             f"({indices.shape[0]}), got {indptr.tolist()[:8]}; pass FlashInfer's kv_indptr")
        indices = indices[:int(indptr[-1])]
        if indices.numel() and (indices.min() < 0 or indices.max() >= num_pages):
            raise ValueError(f"indices must be pages in [0, {num_pages}), got values from {int(indices.min())} to "
                             f"{int(indices.max())}; pass page ids of k_pages")
        uses = torch.bincount(indices, minlength=num_pages)
        if (uses > 1).any():
            page = int(torch.nonzero(uses > 1)[0])
            raise ValueError(f"each page may belong to one sequence once, got page {page} {int(uses[page])} times; "
                             f"appends would write into it for several sequences, so copy shared pages first")
        full = counts > 0
        if ((last < 1) | (last > P))[full].any():
            raise ValueError(f"last_page_len must be in [1, {P}] (page_size) for a sequence with pages, got "
                             f"{last.tolist()[:8]} for {counts.tolist()[:8]} pages; pass FlashInfer's kv_last_page_len")
        max_pages_per_seq = _check_layout(num_pages, P, B, max_pages_per_seq)
        if counts.max() > max_pages_per_seq:
            raise ValueError(f"sequence {int(counts.argmax())} has {int(counts.max())} pages, more than "
                             f"max_pages_per_seq={max_pages_per_seq}; pass a larger max_pages_per_seq")
        cache = cls.__new__(cls)
        cache._adopt(k_pages, v_pages, B, max_pages_per_seq)
        rows = torch.repeat_interleave(torch.arange(B), counts)
        columns = torch.arange(indices.shape[0]) - torch.repeat_interleave(indptr[:-1], counts)
        page_table = torch.zeros(B, cache.max_pages_per_seq, dtype=torch.int32)
        page_table[rows, columns] = indices.int()
        cache.page_table.copy_(page_table)
        cache.lens.copy_(torch.where(full, (counts - 1) * P + last, 0))
        unused = torch.nonzero(uses == 0).flatten().flip(0)  # popped lowest first, as in a fresh cache
        cache._free[:unused.shape[0]].copy_(unused)
        cache._top.fill_(unused.shape[0])
        return cache

    def append(self, seq_ids, k: torch.Tensor, v: torch.Tensor, *, check: bool = True) -> None:
        """Writes k [B, Hkv, T, D] and v [B, Hkv, T, Dv] (any strides) after the tokens of
        slots seq_ids [B] (distinct), taking new pages from the free stack.

        All or nothing: a batch that needs more pages than are free, would take a slot past
        `capacity` tokens, or names a bad slot stores nothing (lens, the pages in use and the
        free stack stay as they were). With check=True (and outside CUDA
        graph capture) append waits for the kernel and raises then; otherwise the next check()
        or checked append raises.

        >>> cache.append(torch.tensor([3, 5], device="cuda"), k, v)
        """
        seq_ids = self._seq_ids(seq_ids)
        self._check_kv(seq_ids, k, v)
        B, H, T, _ = k.shape
        if B and T:
            block_h, block_d, block_dv = (triton.next_power_of_2(n) for n in (H, self.head_dim, self.head_dim_v))
            block_t = min(triton.next_power_of_2(T), max(1, _TILE // (block_h * max(block_d, block_dv))))
            kernel = self._kernel("append_kernel")
            with self._on_device():
                kernel[(triton.cdiv(T, block_t), B)](
                    seq_ids=seq_ids, B=B, T=T, k=k, v=v, k_pages=self.k_pages, v_pages=self.v_pages,
                    page_table=self.page_table, lens=self.lens, free=self._free, top=self._top, counter=self._counter,
                    marks=self._marks, status=self._status,
                    **_strides("stride_k", "bhtd", k), **_strides("stride_v", "bhtd", v),
                    **_strides("stride_kp", "nphd", self.k_pages), **_strides("stride_vp", "nphd", self.v_pages),
                    stride_table=self.page_table.stride(0), max_seqs=self.max_seqs, capacity=self.capacity, H=H,
                    D=self.head_dim, DV=self.head_dim_v, P=self.page_size, BLOCK_B=triton.next_power_of_2(B),
                    BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv)
        if check and not self._capturing():
            self.check()

    def free(self, seq_ids) -> None:
        """Gives the pages of slots seq_ids (distinct) back to the free stack and empties the
        slots, without waiting for the device. A bad or repeated slot frees nothing and is
        reported by the next check() or checked append.

        >>> cache.free(torch.tensor([3], device="cuda"))
        """
        seq_ids = self._seq_ids(seq_ids)
        if seq_ids.shape[0] == 0:
            return
        kernel = self._kernel("free_kernel")
        with self._on_device():
            kernel[(1,)](seq_ids=seq_ids, B=seq_ids.shape[0], page_table=self.page_table,
                         stride_table=self.page_table.stride(0), lens=self.lens, free=self._free, top=self._top,
                         marks=self._marks, status=self._status, max_seqs=self.max_seqs, P=self.page_size,
                         BLOCK_B=triton.next_power_of_2(seq_ids.shape[0]),
                         BLOCK_PAGES=min(_FREE_BLOCK, triton.next_power_of_2(self.max_pages_per_seq)))

    def free_pages(self) -> int:
        """The number of free pages (waits for the device)."""
        return int(self._top.item())

    def check(self) -> None:
        """Raises what the first call refused since the last check() (waits for the device):
        CacheFullError when out of pages or over a slot's capacity, ValueError for a bad slot.
        Not inside CUDA graph capture."""
        failures, kind, op, a, b, c = self._status.tolist()
        if failures == 0:
            return
        self._status.zero_()
        kernels = self._kernels()
        done = "stored" if op == kernels.APPEND.value else "freed"
        if kind == kernels.OUT_OF_PAGES.value:
            error = CacheFullError(f"the append needs {a} new pages but {b} of the cache's {self.num_pages} are free; "
                                   f"nothing was written; free finished slots with cache.free(seq_ids) or build a "
                                   f"PagedKVCache with more pages")
        elif kind == kernels.OVER_CAPACITY.value:
            error = CacheFullError(f"slot {a} holds {b} tokens and appending {c} would pass its capacity of "
                                   f"{self.capacity} (max_pages_per_seq={self.max_pages_per_seq} x page_size="
                                   f"{self.page_size}); nothing was written; free the slot or build the cache with a "
                                   f"larger max_pages_per_seq")
        elif kind == kernels.BAD_SLOT.value:
            error = ValueError(f"seq_ids must be slots in [0, {self.max_seqs}), got {a}; nothing was {done}; pass "
                               f"slots below max_seqs")
        else:
            error = ValueError(f"seq_ids must be distinct, got slot {a} twice; nothing was {done}; name each slot "
                               f"once per call")
        if failures > 1:
            error.args = (f"{failures} calls were refused since the last check(); the first: {error.args[0]}",)
        raise error

    def gather(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k [Hkv, len, D], v [Hkv, len, Dv]): copies of the tokens slot `slot` holds, read
        through page_table and lens (waits for the device). For tests and inspection.

        >>> k, v = cache.gather(0)
        """
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot must be an int in [0, {self.max_seqs}), got {slot!r}")
        n = int(self.lens[slot])
        pages = self.page_table[slot, :triton.cdiv(n, self.page_size)].long()
        return tuple(p[pages].flatten(0, 1)[:n].transpose(0, 1) for p in (self.k_pages, self.v_pages))

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, num_kv_heads="
                f"{self.num_kv_heads}, head_dim={self.head_dim}, head_dim_v={self.head_dim_v}, dtype={self.dtype}, "
                f"device={self.device}, max_seqs={self.max_seqs}, max_pages_per_seq={self.max_pages_per_seq})")

    def _kernels(self):
        interpret = self.device.type != "cuda"
        with _LOCK:
            if interpret not in _MODULES:
                _MODULES[interpret] = loader.load(_KERNELS_FILE, interpret=interpret)
            return _MODULES[interpret]

    def _kernel(self, name: str):
        fn = getattr(self._kernels(), name)
        return _Interpreted(fn) if self.device.type != "cuda" else fn

    def _on_device(self):
        # NOTE: Triton launches on the current CUDA device, whatever device the tensors are on
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _seq_ids(self, seq_ids) -> torch.Tensor:
        # NOTE: a list is refused rather than copied: a copy from the host waits for the device and
        # cannot be captured in a CUDA graph
        # Not narrowed: the kernels read any integer width, so a slot outside [0, max_seqs) is
        # refused with its own value.
        seq_ids = plan.index_argument("seq_ids", seq_ids, what="a 1-d integer tensor of slots",
                                      fix="pass torch.tensor([...], device=cache.device)", device=self.device,
                                      owner="cache")
        if seq_ids.shape[0] > min(self.max_seqs, _MAX_BATCH):
            raise ValueError(f"seq_ids names {seq_ids.shape[0]} slots but a call takes at most "
                             f"{min(self.max_seqs, _MAX_BATCH)} distinct ones (max_seqs={self.max_seqs}); split it")
        return seq_ids

    def _check_kv(self, seq_ids: torch.Tensor, k, v) -> None:
        for name, t, d in (("k", k, self.head_dim), ("v", v, self.head_dim_v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must have 4 dimensions [B, Hkv, T, D], got shape {tuple(t.shape)}; "
                                 f"pass one row per slot of seq_ids")
            if t.shape[1] != self.num_kv_heads:
                raise ValueError(f"{name} has {t.shape[1]} heads but the cache holds {self.num_kv_heads} kv heads; "
                                 f"pass k and v before any repeat for grouped-query attention")
            if t.shape[3] != d:
                raise ValueError(f"{name} has head dim {t.shape[3]} but the cache's is {d}; build the cache with "
                                 f"{'head_dim' if name == 'k' else 'head_dim_v'}={t.shape[3]}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} is {t.dtype} but the cache holds {self.dtype}; cast it with "
                                f".to(cache.dtype)")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}; move it with "
                                 f".to(cache.device)")
        if k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must have one batch and length, got k {tuple(k.shape)} and v {tuple(v.shape)}")
        if k.shape[0] != seq_ids.shape[0]:
            raise ValueError(f"k and v have batch {k.shape[0]} but seq_ids names {seq_ids.shape[0]} slots; pass one "
                             f"row per slot")
        if k.shape[2] > self.capacity:
            raise CacheFullError(f"appending {k.shape[2]} tokens passes a slot's capacity of {self.capacity} "
                                 f"(max_pages_per_seq={self.max_pages_per_seq} x page_size={self.page_size}); "
                                 f"build the cache with a larger max_pages_per_seq")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_layout(num_pages: int, page_size: int, max_seqs: int, max_pages_per_seq: int | None) -> int:
    """max_pages_per_seq once the sizes are checked: by default the pages of DEFAULT_CAPACITY
    tokens, or all of them where there are fewer."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("max_seqs", max_seqs)):
        _check_positive(name, value)
    if max_pages_per_seq is None:
        max_pages_per_seq = min(num_pages, -(-DEFAULT_CAPACITY // page_size))
    _check_positive("max_pages_per_seq", max_pages_per_seq)
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}; pass 1, 16, 64, 128, ...")
    if max(num_pages, max_pages_per_seq * page_size) > _INT32_MAX:
        raise ValueError(f"pages and positions are int32: num_pages {num_pages} and a slot's capacity "
                         f"{max_pages_per_seq * page_size} (max_pages_per_seq x page_size) must stay below 2**31; "
                         f"pass a smaller max_pages_per_seq")
    return max_pages_per_seq


def _check_pages(k_pages, v_pages) -> None:
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or 0 in t.shape:
            raise ValueError(f"{name} must be a tensor [num_pages, page_size, Hkv, D] (FlashInfer's NHD layout) "
                             f"with no empty dimension, got {_describe(t)}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages and v_pages must share num_pages, page_size and Hkv, got {tuple(k_pages.shape)} "
                         f"and {tuple(v_pages.shape)}")
    if k_pages.dtype != v_pages.dtype or k_pages.device != v_pages.device:
        raise ValueError(f"k_pages and v_pages must share a dtype and device, got {k_pages.dtype} on "
                         f"{k_pages.device} and {v_pages.dtype} on {v_pages.device}")
    if not k_pages.dtype.is_floating_point or k_pages.device.type not in ("cuda", "cpu"):
        raise ValueError(f"the pages must be floating point on CUDA or CPU, got {k_pages.dtype} on {k_pages.device}")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def _strides(prefix: str, letters: str, t: torch.Tensor) -> dict:
    """{prefix + letter: stride} for each dimension of t: `_strides("stride_k", "bhtd", k)`."""
    return {prefix + letter: stride for letter, stride in zip(letters, t.stride())}


__all__ = ["CacheFullError", "PagedKVCache"]
