"""Inference: decoding and chunked prefill over contiguous caches (`kv_lens`) and the paged KV
cache. decode plans and launches the split-KV kernel (templates/attention_decode.py.jinja);
paged holds PagedKVCache, whose appends and frees run the kernels of _cache_kernels.py. Both
ride on the runtime's plans, tiles, kernel cache and launches."""
