"""A model's weight files in the node's page cache: read ahead before an engine starts, and how much is
there (issue 27). Pure: no Ray.

An engine that starts (a deploy, or a wake from warm sleep) reads its weights while vLLM loads them,
after its imports and the start lock. Reading them once beforehand (``read_through``, in a thread the
engine starts first) overlaps that read with whatever comes before. ``posix_fadvise(WILLNEED)`` is
not enough: the kernel reads at most its read-ahead window of each file (8 MiB measured here) and
drops the rest of the advice. What of a file the cache holds is ``mincore`` over a read-only map of
it; ``drop`` evicts clean pages (``posix_fadvise(DONTNEED)``), without root: the benchmark's cold start.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

# What vLLM loads weights from; everything else in a model folder is small (configs, tokenizers).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PAGE = mmap.PAGESIZE


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files under ``folder`` (a model's folder, or its cache entry), largest first."""
    root = Path(folder)
    files = [p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _advise(files: Iterable[Path], advice: int) -> int:
    total = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile (a cache eviction): the engine's own read will say so
        try:
            os.posix_fadvise(fd, 0, 0, advice)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def read_through(folder: str | Path, chunk: int = 8 * 2**20) -> int:
    """Read the folder's weight files once, so the page cache holds them for the engine that loads them
    next; the bytes read. Blocking: run it in a thread beside the engine's start."""
    buf = bytearray(chunk)
    done = 0
    for path in weight_files(folder):
        try:
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while n := f.readinto(buf):
                    done += n
        except OSError:
            continue  # gone meanwhile (a cache eviction): the engine's own read will say so
    return done


def drop(folder: str | Path) -> int:
    """Evict the folder's weight files from the page cache (their clean pages); the bytes asked for."""
    return _advise(weight_files(folder), os.POSIX_FADV_DONTNEED)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
MAP_FAILED = ctypes.c_void_p(-1).value
_RESIDENT = bytes(b & 1 for b in range(256))  # a mincore byte -> its resident bit


def _cached_pages(fd: int, size: int) -> int:
    """Pages of an open file the page cache holds: ``mincore`` over a read-only map (reads nothing)."""
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap")
    try:
        vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
        if _libc.mincore(address, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        # bit 0 of each byte: the page is resident (the others are reserved); counted in C, not per page
        # in Python (a 100 GiB model has 26 million pages)
        return bytes(vec).translate(_RESIDENT).count(1)
    finally:
        _libc.munmap(address, size)


def cached_bytes(folder: str | Path) -> tuple[int, int]:
    """(bytes of the folder's weight files in the page cache, their total size)."""
    cached = total = 0
    for path in weight_files(folder):
        size = path.stat().st_size
        total += size
        if size:
            fd = os.open(path, os.O_RDONLY)
            try:
                cached += min(size, _cached_pages(fd, size) * PAGE)
            finally:
                os.close(fd)
    return cached, total
