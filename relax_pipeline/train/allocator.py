"""Keep freed CPU memory inside the training process, so the next micro-batch's large tensors reuse it.

glibc's malloc serves every request above its mmap threshold (at most 32 MiB) with a fresh `mmap` and hands it
back with `munmap` when it is freed. A CPU training step allocates and frees tensors far larger than that many
times over (the logits of a 64-row micro-batch over a 49k vocabulary, their softmax, its gradient and their
casts), and every fresh one is zeroed and mapped page by page on first touch. The functions here choose what the
process does with freed memory, once, before the run starts any thread (`recipes/train.py` calls them first):

- `keep_freed_cpu_memory` (`trainer.keep_freed_memory`, null: on when the trainer's device is the CPU) tells malloc
  (through `mallopt`) to serve large requests from its heap and never to trim it, so freed buffers stay mapped and
  are reused. The price: the process keeps its peak resident size, and the heap fragments (a step's freed tensors
  leave holes the next step's differently sized ones do not fit). DeepSpeed worker ranks call it in their own
  processes. It is process-wide and is not undone.
- `bound_cpu_memory` is the other policy, for a run whose peak matters more than its page faults
  (`trainer.keep_freed_memory=false` on a CPU; `experiment=smollm2_agent` chooses it): every chunk of 4 MiB or more
  mapped fresh and returned when freed, so the resident size follows what is live.
- Either policy limits the process to one malloc arena (glibc gives each allocating thread its own, each keeping
  its own peak), so what training frees the engine reuses, and the reverse.
- `cap_kernel_cache` caps oneDNN's cache of compiled kernels (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's cache of
  prepared matmuls (`LRU_CACHE_CAPACITY`) at `KERNEL_CACHE` for a CPU training run, each unless the user set it:
  training and decode shapes change every step, and uncapped caches keep the kernels of every past shape alive.
  Both are read at the first matmul, so it must run before any.
- `release_freed_memory` hands the heap's free pages back to the system (glibc's `malloc_trim`); the step loop calls
  it once a step, after its checkpoint and eval, whose copies and sessions leave holes the next steps need only in
  part.
- `TrainingThread` runs all of a trainer's heavy work (train, load, the engine's weight copy) on one thread of its
  own; the torch trainer uses it whenever it keeps freed memory.

What each policy costs and saves (peaks, page faults, step times, the allocators tried instead) is measured on the
benchmarks page, docs/benchmarks.md ("The step and its memory").

What this module does not do: anything off glibc (musl, macOS: a no-op that returns False), GPU memory (the
CUDA caching allocator already reuses blocks), or replace the allocator (jemalloc or tcmalloc through
LD_PRELOAD serve the same purpose where they are installed).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)
Result = TypeVar("Result")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -3, -4, -8
"""glibc's `mallopt` parameter numbers (malloc.h)."""
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))
"""Kept: one arena for every thread; no mmap'd chunks; never trim the heap; grow it 64 MiB beyond each request."""
BOUNDED = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 4 << 20))
"""Bounded: one arena for every thread; chunks of 4 MiB and more mapped fresh and returned when freed."""


KERNEL_CACHE = 64
"""oneDNN kernels (and ideep prepared matmuls) a CPU training process keeps: a step's forward, backward and the
engine's decode use about 30."""
KERNEL_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE_VARIABLE = "LRU_CACHE_CAPACITY"
"""ideep's own cache of prepared matmuls (torch's CPU bf16 path), 1,024 by default; each holds its oneDNN kernels."""
CACHE_VARIABLES = (KERNEL_CACHE_VARIABLE, IDEEP_CACHE_VARIABLE)
"""What `cap_kernel_cache` sets."""


def cap_kernel_cache(capacity: int = KERNEL_CACHE) -> bool:
    """Cap oneDNN's kernel cache and ideep's cache of prepared matmuls at `capacity` (see the module), each unless
    the environment already sets it; True when this call set either. Effective only before the first matmul."""
    unset = [name for name in CACHE_VARIABLES if name not in os.environ]
    for name in unset:
        os.environ[name] = str(capacity)
    return bool(unset)


def keep_freed_cpu_memory() -> bool:
    """Set `SETTINGS` for this process; True when glibc accepted them, False where there is no `mallopt`."""
    return _mallopt(SETTINGS)


def bound_cpu_memory() -> bool:
    """Set `BOUNDED` for this process (see the module); True when glibc accepted them."""
    return _mallopt(BOUNDED)


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        log.info("no glibc mallopt here: freed CPU memory is returned to the system as usual")
        return False
    return all(mallopt(option, value) == 1 for option, value in settings)


def release_freed_memory() -> bool:
    """Give the free pages inside malloc's heaps back to the system (glibc `malloc_trim(0)`; see the module);
    True when glibc released any, False where there is none or it had nothing to give."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return trim is not None and trim(0) == 1


def _glibc(name: str, argtypes: list[Any]) -> Any:
    """This process's C library function `name` returning an int, or None where it has none (musl, macOS)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def wants_freed_memory_kept(setting: bool | None, device: str) -> bool:
    """`trainer.keep_freed_memory`: an explicit value wins; null means on for a CPU device."""
    return setting if setting is not None else device.split(":")[0] == "cpu"


class TrainingThread:
    """One thread, started on first use, that runs a trainer's work (see the module); disabled, the caller's."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._ident: int | None = None

    def run(self, work: Callable[..., Result], *args: Any) -> Result:
        """`work(*args)` on the training thread (directly when disabled or already on it); its result or error."""
        if not self.enabled or threading.get_ident() == self._ident:
            return work(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer")
            self._ident = self._pool.submit(threading.get_ident).result()
        return self._pool.submit(work, *args).result()

    def close(self) -> None:
        """Stop the thread (after its current work); a later `run` starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool, self._ident = None, None
