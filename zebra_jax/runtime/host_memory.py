"""Host memory that XLA's CPU runtime reuses instead of faulting in anew.

On a CPU, every call of a compiled program allocates its temporaries as one
block (for one grouped layer's forward and backward pass, larger than the
heap described next) from one of the runtime's worker threads.
glibc gives those threads arenas of their own, and an arena other than the
main one serves any request larger than its 64 MB heap with a fresh `mmap`,
unmapped again when freed. Each call then touches every page of its
temporaries for the first time: a page fault per page, each a trap into
the kernel and a page zeroed, which made the layer markedly slower than the
same program on memory it had used before.

`reuse_freed_host_memory` sets glibc's malloc, through `mallopt`, so that every
thread allocates from the main arena, never with `mmap`, and freed memory stays
with the process for the next call (while the heap settles in a program's
first calls, an odd call can still land on untouched memory; the median call
faults in nothing). The price: the process keeps its
high-water mark of host memory instead of returning it to the system, and
threads share one arena's lock, which makes XLA's (multi-threaded)
compilation slower: paid once per program, against every step. The main
job (the demo config, then its evaluation and sample) trained faster with
the settings than without, for a little more resident memory at its
peak.
Importing the package changes nothing: the entry points call it first
(`zebra-jax` and `python -m zebra_jax.main` in main.run, the tools in
cli/entry.run_tool, lab/bench.py), before JAX starts its backend: a thread
picks its arena at its first allocation, so setting it later leaves the
runtime's threads where they are. A program of one's own that imports the
package calls `reuse_freed_host_memory()` before its first computation for
the same effect. Only where the computation will run on the CPU
(JAX_PLATFORMS names the CPU first, or no accelerator plugin for JAX is
installed) and the C library is glibc; ZEBRA_JAX_SYSTEM_MALLOC=1 in the
environment opts out. These are glibc's documented `mallopt` parameters
(MALLOC_ARENA_MAX, MALLOC_MMAP_MAX_ and MALLOC_TRIM_THRESHOLD_ set the same
before a process starts); no allocator is replaced. `settings_in_effect`
observes them (a large block served without `mmap`) rather than recalling
the call.
"""

import ctypes
import importlib.util
import os

OPT_OUT = "ZEBRA_JAX_SYSTEM_MALLOC"

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP_ALL = 2**31 - 1  # trim threshold: never give the heap's top back


def computes_on_cpu() -> bool:
  """Whether JAX will run on the CPU, judged before it starts: the first
  platform JAX_PLATFORMS names, else whether an accelerator plugin is
  installed (the CUDA and ROCm plugins live in the `jax_plugins` namespace
  package; looking it up is cheap, where listing every installed
  distribution's entry points would add to each start)."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return importlib.util.find_spec("jax_plugins") is None


def is_glibc() -> bool:
  """Whether the C library is glibc, whose mallopt parameters these are."""
  try:
    return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
  except (AttributeError, ValueError, OSError):  # not a glibc system
    return False


def reuse_freed_host_memory() -> bool:
  """Sets glibc's malloc as the module docstring says; True if it did."""
  if os.environ.get(OPT_OUT) == "1" or not computes_on_cpu():
    return False
  if not is_glibc():
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  # Every parameter is set, whichever fails (mallopt returns 1 on success).
  results = [mallopt(param, value) for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_ALL))]
  return results == [1, 1, 1]


class _MallInfo2(ctypes.Structure):
  """glibc's struct mallinfo2 (glibc 2.33+), every field a size_t."""
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
      "uordblks", "fordblks", "keepcost")]


def settings_in_effect() -> bool:
  """Whether this process's malloc serves a 64 MiB block (above the largest
  mmap threshold glibc adapts to, 32 MiB) without a fresh `mmap`: True once
  reuse_freed_host_memory has run, False under glibc's defaults."""
  if not is_glibc():
    return False
  libc = ctypes.CDLL(None)
  if not hasattr(libc, "mallinfo2"):
    return False
  libc.mallinfo2.restype = _MallInfo2
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (
      ctypes.c_size_t,)
  libc.free.argtypes = (ctypes.c_void_p,)
  before = libc.mallinfo2().hblks
  block = libc.malloc(64 << 20)
  mapped = libc.mallinfo2().hblks > before
  libc.free(block)
  return block is not None and not mapped
