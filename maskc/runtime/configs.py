"""Tile shapes and launch options per head dim and device: Python decides them here."""
from __future__ import annotations

import contextlib
from typing import NamedTuple


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


_override: TileConfig | None = None


@contextlib.contextmanager
def use_config(config: TileConfig):
    """Force one tile config inside the block (benchmarks/tune_forward.py sweeps with it)."""
    global _override
    saved, _override = _override, config
    try:
        yield
    finally:
        _override = saved


def forward_config(head_dim: int, device_type: str) -> TileConfig:
    if _override is not None:
        return _override
    if device_type != "cuda":
        # The interpreter runs each tile op in numpy: small tiles keep tests quick and
        # still exercise several tiles per row.
        return TileConfig(32, 32, 4, 1)
    if head_dim <= 128:
        # Swept on an H100 (benchmarks/NOTES.md): 64×64 tiles with 4 warps beat 128×64 with
        # 8 warps on causal, sliding window and softcap at D=64 and D=128.
        return TileConfig(64, 64, 4, 3)
    return TileConfig(64, 32, 4, 2)


def padded(dim: int) -> int:
    """Head dims are padded to a power of two of at least 16 (the smallest tl.dot)."""
    return max(16, 1 << (dim - 1).bit_length())
