"""References, assertions and hypothesis strategies for testing masks and kernels.

>>> from maskc.testing import attention_reference, assert_block_map_exact
>>> assert_block_map_exact(maskc.masks.sliding_window(100), q_len=1000, kv_len=1000, block_size=(64, 64))
"""
from maskc.testing.asserts import assert_block_map_exact, assert_block_map_sound, assert_close_to_reference
from maskc.testing.reference import attention_reference, dense_mask, dense_tiles

__all__ = ["assert_block_map_exact", "assert_block_map_sound", "assert_close_to_reference", "attention_reference",
           "dense_mask", "dense_tiles"]
