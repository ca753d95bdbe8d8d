"""Process-wide settings of the C allocator (no torch, no vllm: any process may call them)."""

from __future__ import annotations

import ctypes
import ctypes.util


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep freed memory for reuse: no block gets its own mapping (those
    are unmapped on free, and over 32 MB every block gets one) and the heap top is trimmed only
    past 2 GB. The process then stays at its peak size. Returns False where this is not glibc
    (nothing changed).

    Who calls it: the CPU trainer (a step's activations were re-faulted page by page every step)
    and the transfer queue's service processes (every put arrives in fresh ZeroMQ buffers of a few
    MB and every clear frees them: ~6,000 page faults per 26.6 MB round in ``psrl bench queue``,
    a third of its time, until glibc's adaptive threshold caught up after about seven rounds).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))
