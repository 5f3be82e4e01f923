"""The C heap under PyTorch's CPU tensors (glibc's malloc; elsewhere these do nothing).

By default glibc hands a freed block over 32 MB back to the OS, so a loop that allocates and frees
large temporaries page-faults them in again, zeroed, on every first touch (benchmarks/HISTORY.md
has the measurements: decode steps and training steps alike). :func:`keep_freed_memory` keeps
them; :func:`trim_heap` returns the free pages when a caller knows it is a good time.
"""

import ctypes
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h


@functools.cache
def _libc():
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory(trim_threshold: int, mmap_threshold: int | None = None) -> bool:
    """Freed memory stays in the heap: up to ``trim_threshold`` bytes free at its top before glibc
    trims it; blocks up to ``mmap_threshold`` bytes come from the heap (None: every block does, none
    is mapped on its own). Process-wide. False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    if mmap_threshold is None:
        mapped = libc.mallopt(_M_MMAP_MAX, 0)
    else:
        mapped = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    return bool(mapped) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def trim_heap() -> None:
    """Returns the heap's free pages to the OS (glibc's ``malloc_trim``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
