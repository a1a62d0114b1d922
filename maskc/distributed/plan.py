"""plan(): the ContextParallelPlan of a mask over a process group (layout.py chooses the layout)."""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from maskc.analysis.build import block_map
from maskc.distributed import agree
from maskc.distributed import layout as layouts
from maskc.trace import symbols
from maskc.trace.dag import free_symbols
from maskc.trace.mods import as_mask_mod


class ContextParallelPlan:
    """Which token positions each rank of `group` owns, and the ring schedule of the mask.

    >>> plan = maskc.distributed.plan(maskc.masks.causal, 131072)
    >>> q = plan.shard(q_full)                        # this rank's rows, [B, H, plan.local_len, D]
    >>> out = maskc.distributed.attention(q, k, v, plan)
    >>> full = plan.unshard(out)                      # every rank's rows, in the original order

    `layout` names the choice ("contiguous", "zigzag" or "balanced"); `steps` are the ring
    steps at which some rank computes (step s: each rank r meets the keys of rank r - s);
    `skipped_steps` counts the others, which send nothing."""

    def __init__(self, mask_mod, seq_len: int, block_size: int, layout: layouts.Layout, group, rank: int,
                 reads: dict, fingerprint: int):
        self.mask_mod = mask_mod
        # the digest of mask, length and layout that every rank of the group agreed on in plan()
        self._fingerprint = fingerprint
        self._reads = reads  # {"b": B, "h": H} for the index arguments the mask reads: the map holds for those
        self.seq_len = seq_len
        self.block_size = block_size
        self.group = group
        self.rank = rank
        self.world_size = layout.world_size
        self.layout = layout.name
        self._layout = layout
        # the mask's trace and its tensors' stamps (Traced.stamps: version and storage, so that
        # `ids.data = new` shows too) when planned, with the storages that keep the stamps' pointers
        # theirs: a mask that changed since would keep pairs the plan skips
        self._traced = mask_mod.traced if mask_mod is not None else None
        self._stamps = self._traced.stamps() if self._traced is not None else ()
        self._storages = self._traced.storages() if self._traced is not None else ()
        self.lengths = tuple(sum(e - s for s, e in (layout.bounds[c] for c in owned)) for owned in layout.owned)
        self.local_len = self.lengths[rank]
        self.steps = layout.steps
        self.skipped_steps = self.world_size - len(self.steps)
        self.work = tuple(layout.rank_work(r) for r in range(self.world_size))
        self._rings: dict = {}
        # chunks, pairs and keys by their arguments: they derive from the layout alone, and the
        # ring asks for them at every step of every call (host time that short shards pay)
        self._memo: dict = {}

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """The global positions of a rank's rows (this rank's by default), in shard order."""
        owned = self._layout.owned[self.rank if rank is None else rank]
        return torch.cat([torch.arange(*self._layout.bounds[c]) for c in owned])

    def chunks(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        """(chunk, its global start, its offset in the rank's shard) for each chunk of `rank`."""
        return self._memoised(("chunks", rank), lambda: self._chunks(rank))

    def _chunks(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        out, offset = [], 0
        for c in self._layout.owned[rank]:
            start, end = self._layout.bounds[c]
            out.append((c, start, offset))
            offset += end - start
        return tuple(out)

    def chunk_length(self, chunk: int) -> int:
        start, end = self._layout.bounds[chunk]
        return end - start

    def pairs(self, step: int, rank: int | None = None) -> tuple[tuple[int, int], ...]:
        """The (query chunk, key chunk) pairs a rank computes at ring step `step`."""
        rank = self.rank if rank is None else rank
        return self._memoised(("pairs", step, rank), lambda: self._layout.pairs(step, rank))

    def keys_needed(self, step: int, rank: int | None = None) -> tuple[tuple[int, int, int], ...]:
        """(key chunk, lo, hi) for each chunk of rank - step whose keys [lo, hi) (offsets from the
        chunk's start) a rank reads at `step`, in that rank's shard order: what travels at the step."""
        rank = self.rank if rank is None else rank
        return self._memoised(("keys", step, rank), lambda: self._keys_needed(step, rank))

    def _memoised(self, key, make):
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = make()
        return found

    def _keys_needed(self, step: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        pairs = self.pairs(step, rank)
        needed = []
        for kc in self._layout.owned[(rank - step) % self.world_size]:
            spans = [self._layout.ranges[(qc, c)][2:] for qc, c in pairs if c == kc]
            if spans:
                needed.append((kc, min(lo for lo, _ in spans), max(hi for _, hi in spans)))
        return tuple(needed)

    def shard(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """This rank's rows of a full-length tensor (positions along `dim`, [B, H, L, D] by default)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"shard takes a full-length tensor: dimension {dim} must be the plan's seq_len "
                             f"{self.seq_len}, got shape {tuple(x.shape)}; pass dim= where positions lie elsewhere")
        return torch.cat([x.narrow(dim, self._layout.bounds[c][0], self.chunk_length(c))
                          for c in self._layout.owned[self.rank]], dim=dim)

    def unshard(self, y: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """Every rank's shard gathered into the full-length tensor, in the original order (a
        collective: every rank of the group calls it). Values only: the result has no gradient."""
        if y.shape[dim] != self.local_len:
            raise ValueError(f"unshard takes this rank's shard: dimension {dim} must be {self.local_len}, got "
                             f"shape {tuple(y.shape)}")
        width = max(self.lengths)
        padded = torch.zeros((*y.shape[:dim], width, *y.shape[dim + 1:]), dtype=y.dtype, device=y.device)
        padded.narrow(dim, 0, self.local_len).copy_(y.detach())
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded.contiguous(), group=self.group)
        full = torch.empty((*y.shape[:dim], self.seq_len, *y.shape[dim + 1:]), dtype=y.dtype, device=y.device)
        for r, part in enumerate(gathered):
            for c, start, offset in self.chunks(r):
                length = self.chunk_length(c)
                full.narrow(dim, start, length).copy_(part.narrow(dim, offset, length))
        return full

    def check_current(self, B: int, H: int) -> None:
        """Refuse a plan whose mask changed since it was made (a captured number or tensor), or
        that was made for another batch size or head count where the mask reads b or h."""
        if self.mask_mod is None:
            return
        for name, planned, got in (("b", self._reads.get("b"), B), ("h", self._reads.get("h"), H)):
            if planned is not None and planned != got:
                what = "batch size B" if name == "b" else "number of query heads H"
                raise ValueError(f"mask_mod '{self.mask_mod.__name__}' reads {name}, and this plan was made for "
                                 f"{what}={planned} but q has {got}; make the plan with "
                                 f"maskc.distributed.plan(..., {name.upper()}={got})")
        if self.mask_mod.traced is not self._traced or self._traced.stamps() != self._stamps:
            raise ValueError(f"mask_mod '{self.mask_mod.__name__}' changed since this plan was made (a number or "
                             f"tensor it captures has a new value), so the plan may skip pairs it now keeps; "
                             f"make a new plan with maskc.distributed.plan")

    def __repr__(self) -> str:
        name = self.mask_mod.__name__ if self.mask_mod is not None else "no mask"
        return (f"ContextParallelPlan({name}, seq_len={self.seq_len}, ranks={self.world_size}, layout={self.layout}, "
                f"steps={list(self.steps)}, work per rank={list(self.work)})")


def plan(mask_mod, seq_len: int, *, group=None, block_size: int = 128, B: int | None = None,
         H: int | None = None) -> ContextParallelPlan:
    """Shard a sequence of `seq_len` tokens over the ranks of `group` (the default group when
    None) for maskc.distributed.attention, balancing the tiles `mask_mod` keeps.

    Every rank calls it with the same mask and length (it checks, with one all-gather). A causal
    mask gets the zigzag split where its tiles cut into 2N equal chunks (otherwise a finer
    balanced split may leave the busiest rank less); a sliding window, contiguous shards; other
    masks the balance their block map gives (`plan.layout` names the choice). B and H are needed
    only when the mask reads b or h.

    >>> plan = maskc.distributed.plan(maskc.masks.sliding_window(4096), 131072)
    >>> plan.skipped_steps          # ring steps no rank computes, which send nothing
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("maskc.distributed.plan needs an initialised process group; call "
                           "torch.distributed.init_process_group (NCCL on GPUs, gloo on CPU) first, as torchrun "
                           "scripts do")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}; pass the full sequence length")
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two from 16, got {block_size!r}")
    mask = as_mask_mod(mask_mod)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    reads = {}
    if mask is None:
        tiles = -(-seq_len // block_size)
        kept = torch.ones(tiles, tiles, dtype=torch.int64)
    else:
        # built where the mask's captured tensors live (the GPU for document ids there)
        bm = block_map(mask, seq_len, seq_len, block_size=(block_size, block_size), B=B, H=H)
        kept = (bm.to_dense() > 0).sum(dim=(0, 1)).cpu()
        free = free_symbols(mask.traced.expr)
        reads = {name: size for name, symbol, size in (("b", symbols.B, B), ("h", symbols.H, H)) if symbol in free}
    chosen = layouts.choose(kept, seq_len, block_size, world_size)
    fingerprint = _check_agreement(mask, chosen, seq_len, block_size, reads, group, rank)
    return ContextParallelPlan(mask, seq_len, block_size, chosen, group, rank, reads, fingerprint)


def _check_agreement(mask, chosen: layouts.Layout, seq_len: int, block_size: int, reads: dict, group,
                     rank: int) -> int:
    """Every rank must plan the same mask and layout, or the ring would pair mismatched shards
    or each rank would run its own mask; this all-gather is also the group's first collective,
    which NCCL's batched point-to-point needs. Returns the plan's fingerprint, the same on every rank."""
    what = (seq_len, block_size, chosen, sorted(reads.items()))
    if mask is not None:
        traced = mask.traced
        # the captured tensors' bytes: document ids built differently on two ranks must not pass
        what += (traced.signature, [p.value for p in traced.params],
                 [zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                  for t in traced.tensors])
    fingerprint = zlib.crc32(repr(what).encode())
    mine = torch.tensor([seq_len, fingerprint], dtype=torch.int64, device=agree.device(group))
    for r, theirs in enumerate(agree.gathered(mine, group, chosen.world_size)):
        if not torch.equal(theirs, mine):
            length = int(theirs[0])
            raise ValueError(f"every rank must call maskc.distributed.plan with the same mask_mod and seq_len: rank "
                             f"{rank} has seq_len {seq_len} and rank {r} has {length}"
                             + ("" if length != seq_len else " with another mask (or other captured values)")
                             + "; build the mask from the same values on every rank")
    return fingerprint


__all__ = ["ContextParallelPlan", "plan"]
