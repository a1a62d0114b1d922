"""Where each rank's tokens lie, chosen from the global block map; no process group here.

The sequence is cut into chunks at tile boundaries. A layout gives each rank some chunks (its
shard is their concatenation, in order); rank r's queries then need the keys of rank
(r - s) mod N at ring step s only where some (query chunk, key chunk) pair keeps a tile.
Candidates:
- contiguous: N chunks, rank r the r-th (sliding windows: each rank needs its neighbour only);
- zigzag: 2N chunks, rank r chunks r and 2N-1-r (causal: a cheap head with an expensive tail);
- balanced: 2N, 3N or 4N chunks handed out evenly, heaviest first, each to the lightest rank
  (documents and other irregular masks: more chunks balance finer, at more launches).
The layout with the least work on its busiest rank wins; among those within 2% of it, the
one whose ring has fewer steps with work (less to send), then the one with fewer chunks, then
the listed order. Work counts the tiles the mask keeps, FULL and PARTIAL alike.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

_TOLERANCE = 1.02


@dataclass(frozen=True)
class Layout:
    """A choice of chunks and owners, with the work it gives each rank and each ring step."""

    name: str
    bounds: tuple[tuple[int, int], ...]  # chunk c covers global positions [start, end)
    owned: tuple[tuple[int, ...], ...]  # owned[r]: rank r's chunks, in shard order
    pair_work: tuple[tuple[int, ...], ...]  # pair_work[qc][kc]: tiles kept where chunk qc's queries meet kc's keys
    # ranges[(qc, kc)] = (q_lo, q_hi, kv_lo, kv_hi): the rows of chunk qc and keys of chunk kc (offsets
    # from each chunk's start, at tile boundaries) inside which every kept tile of the pair lies
    ranges: dict

    @property
    def world_size(self) -> int:
        return len(self.owned)

    def pairs(self, step: int, rank: int) -> tuple[tuple[int, int], ...]:
        """The (query chunk, key chunk) pairs rank `rank` computes at ring step `step`, with the
        keys of rank (rank - step) mod N; pairs that keep no tile are left out."""
        source = (rank - step) % self.world_size
        return tuple((qc, kc) for qc in self.owned[rank] for kc in self.owned[source] if self.pair_work[qc][kc])

    def rank_work(self, rank: int) -> int:
        return sum(self.pair_work[qc][kc] for qc in self.owned[rank] for kc in range(len(self.bounds)))

    @property
    def busiest(self) -> int:
        return max(self.rank_work(r) for r in range(self.world_size))

    @property
    def steps(self) -> tuple[int, ...]:
        """The ring steps at which some rank computes (step 0, each rank's own keys, included
        where it keeps a tile)."""
        n = self.world_size
        return tuple(s for s in range(n) if any(self.pairs(s, r) for r in range(n)))


def choose(kept: torch.Tensor, seq_len: int, block_size: int, world_size: int) -> Layout:
    """The layout for a mask whose kept tiles are `kept` (a bool or int grid [q tiles, kv tiles]
    of the seq_len × seq_len matrix at `block_size`)."""
    n = world_size
    candidates = [_layout("contiguous", kept, seq_len, block_size, n, [(r,) for r in range(n)])]
    if n > 1:
        candidates.append(_layout("zigzag", kept, seq_len, block_size, 2 * n,
                                  [(r, 2 * n - 1 - r) for r in range(n)]))
        candidates += [_balanced(kept, seq_len, block_size, n, per_rank) for per_rank in (2, 3, 4)]
    best = min(c.busiest for c in candidates)
    near = [c for c in candidates if c.busiest <= best * _TOLERANCE]
    return min(near, key=lambda c: (len(c.steps), len(c.bounds)))


def _bounds(seq_len: int, block_size: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """`chunks` chunks of nearly equal length, cut at tile boundaries (the last may be ragged,
    and some empty when there are fewer tiles than chunks)."""
    tiles = -(-seq_len // block_size)
    cuts = [min(seq_len, round(i * tiles / chunks) * block_size) for i in range(chunks + 1)]
    return tuple(itertools.pairwise(cuts))


def _pair_work(kept: torch.Tensor, bounds, block_size: int) -> tuple[tuple[int, ...], ...]:
    """Kept tiles summed over each (query chunk, key chunk) block of the tile grid."""
    tile_chunk = torch.empty(kept.shape[0], dtype=torch.long)
    for c, (start, end) in enumerate(bounds):
        if start < end:  # an empty chunk at the end would otherwise take the ragged last tile
            tile_chunk[start // block_size:-(-end // block_size)] = c
    grid = kept.to(torch.int64)
    rows = torch.zeros(len(bounds), grid.shape[1], dtype=torch.int64).index_add_(0, tile_chunk, grid)
    work = torch.zeros(len(bounds), len(bounds), dtype=torch.int64).index_add_(1, tile_chunk, rows)
    return tuple(tuple(row) for row in work.tolist())


def _ranges(kept: torch.Tensor, bounds, block_size: int, work) -> dict:
    """The smallest row and key ranges of each pair that keeps a tile: a sliding window's pair of
    neighbouring chunks computes, merges and differentiates only its corner."""
    ranges = {}
    for qc, (q0, q1) in enumerate(bounds):
        for kc, (k0, k1) in enumerate(bounds):
            if not work[qc][kc]:
                continue
            sub = kept[q0 // block_size:-(-q1 // block_size), k0 // block_size:-(-k1 // block_size)] > 0
            rows, cols = sub.any(dim=1).nonzero().flatten(), sub.any(dim=0).nonzero().flatten()
            ranges[(qc, kc)] = (int(rows[0]) * block_size, min(q1 - q0, (int(rows[-1]) + 1) * block_size),
                                int(cols[0]) * block_size, min(k1 - k0, (int(cols[-1]) + 1) * block_size))
    return ranges


def _layout(name, kept, seq_len, block_size, chunks, owned) -> Layout:
    bounds = _bounds(seq_len, block_size, chunks)
    work = _pair_work(kept, bounds, block_size)
    return Layout(name, bounds, tuple(tuple(o) for o in owned), work, _ranges(kept, bounds, block_size, work))


def _balanced(kept, seq_len, block_size, n, per_rank: int) -> Layout:
    bounds = _bounds(seq_len, block_size, per_rank * n)
    work = _pair_work(kept, bounds, block_size)
    rows = [sum(row) for row in work]
    owned: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for c in sorted(range(per_rank * n), key=lambda c: (-rows[c], c)):
        r = min((r for r in range(n) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(c)
        load[r] += rows[c]
    return Layout("balanced", bounds, tuple(tuple(sorted(o)) for o in owned), work,
                  _ranges(kept, bounds, block_size, work))


__all__ = ["Layout", "choose"]
