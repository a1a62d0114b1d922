"""Stage 4 of the pipeline: cache, load and launch generated kernels."""
from maskc.runtime.attention import compiled_attention
from maskc.runtime.cache import KERNELS, CacheInfo, cache_dir
from maskc.runtime.kernel import CompiledKernel, compile


def cache_info() -> CacheInfo:
    """Counters of the kernel cache: CacheInfo(hits, misses, disk_hits, currsize)."""
    return KERNELS.info()


__all__ = ["CacheInfo", "CompiledKernel", "cache_dir", "cache_info", "compile", "compiled_attention"]
