"""References, assertions and hypothesis strategies for testing masks and kernels.

>>> from maskc.testing import attention_reference, assert_block_map_exact
>>> assert_block_map_exact(maskc.masks.sliding_window(100), q_len=1000, kv_len=1000, block_size=(64, 64))

The strategies need hypothesis (the `test` extra) and are imported on first use:

>>> from maskc.testing import mask_cases
"""
from maskc.testing.asserts import (assert_block_map_exact, assert_block_map_sound, assert_close_to_reference,
                                  assert_gradient_close_to_reference)
from maskc.testing.dropout import dropout_keep, dropout_scale
from maskc.testing.reference import attention_reference, decode_reference, dense_mask, dense_tiles

_STRATEGIES = ("AttentionInputs", "MaskCase", "attention_inputs", "block_sizes", "doc_ids", "lengths", "mask_cases",
               "masks", "score_mods")


def __getattr__(name):
    # NOTE: hypothesis is a test-only dependency; importing maskc.testing must not need it.
    if name in _STRATEGIES:
        from maskc.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'maskc.testing' has no attribute {name!r}")


__all__ = ["assert_block_map_exact", "assert_block_map_sound", "assert_close_to_reference",
           "assert_gradient_close_to_reference", "attention_reference", "decode_reference", "dense_mask", "dense_tiles",
           "dropout_keep", "dropout_scale",
           *_STRATEGIES]
