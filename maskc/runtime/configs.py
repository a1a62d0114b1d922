"""Tile shapes and launch options per head dim and device: Python decides them here."""
from __future__ import annotations

from typing import NamedTuple


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def forward_config(head_dim: int, device_type: str) -> TileConfig:
    if device_type != "cuda":
        # The interpreter runs each tile op in numpy: small tiles keep tests quick and
        # still exercise several tiles per row.
        return TileConfig(32, 32, 4, 1)
    if head_dim <= 64:
        return TileConfig(128, 64, 4, 3)
    if head_dim <= 128:
        return TileConfig(128, 64, 8, 3)
    return TileConfig(64, 32, 4, 2)


def padded(dim: int) -> int:
    """Head dims are padded to a power of two of at least 16 (the smallest tl.dot)."""
    return max(16, 1 << (dim - 1).bit_length())
