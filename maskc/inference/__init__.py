"""Inference: decoding and chunked prefill over contiguous caches (`kv_lens`) and the paged KV
cache. decode plans and launches the split-KV kernel (templates/attention_decode.py.jinja);
paged holds PagedKVCache, whose appends and frees run the kernels of _cache_kernels.py. Both
ride on the runtime's plans, tiles, kernel cache and launches."""
# NOTE: the runtime's package imports these modules (its public functions decode, and take a
# PagedKVCache) while they import its modules; loading the runtime's package first keeps either
# order of first import whole (`import maskc.inference.paged` alone met a half-made module).
import maskc.runtime  # noqa: F401
