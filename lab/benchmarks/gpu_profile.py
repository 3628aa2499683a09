"""The profile stage: a jax.profiler trace of three WikiText-103 steps and
XLA's dump of the step, each packed into one archive small enough to come
back from a node that returns only a few files of limited size.

XLA writes its dump only where XLA_FLAGS=--xla_dump_to=DIR was set before
the process started: the driver sets it for this stage's process
(dump_flags). The dump holds every module the process compiled; the
archive keeps the largest (the train step), and drops its less useful
files first if it would be too large. JAX is imported by the stage alone:
the driver, which never starts a JAX backend, reads dump_flags.
"""

import os
import re
import tarfile
import tempfile

from lab.benchmarks.gpu_budget import RETURNED_FILE_BYTES
from lab.benchmarks.gpu_results import Results, first_error_line

TRACE_ARCHIVE = "profile-trace.tar.gz"
DUMP_ARCHIVE = "xla-dump.tar.gz"
MAX_ARCHIVE_BYTES = RETURNED_FILE_BYTES
DUMP_DIR = "xla_dump"   # under the stage's work folder


def dump_flags(work: str, flags: str = "") -> str:
  """XLA_FLAGS for the profile stage's process: the caller's own, plus the
  dump of every compiled module into work/xla_dump as text, and no CUDA
  graphs. Inside a graph (XLA's command buffers) a trace's kernels all
  name the graph's thunk as their HLO op, and cuBLAS kernels have no other
  name to match the step's HLO by: none of the step's time could be given
  to a part of the model. One launch per kernel costs little beside a
  40 ms step."""
  dump = os.path.join(work, DUMP_DIR)
  return " ".join(filter(None, [flags, f"--xla_dump_to={dump}",
                                "--xla_dump_hlo_as_text",
                                "--xla_gpu_enable_command_buffer="]))


def tensorboard_command(archive: str = TRACE_ARCHIVE) -> str:
  return (f"mkdir -p trace && tar xzf {archive} -C trace && "
          "tensorboard --logdir trace")


def _pack(path: str, files: list[tuple[str, str]]) -> int:
  """files [(path on disk, name in the archive)] into path (gzip); bytes."""
  with tarfile.open(path, "w:gz") as tar:
    for disk, name in files:
      tar.add(disk, arcname=name)
  return os.path.getsize(path)


def _tree(folder: str) -> list[tuple[str, str]]:
  return sorted((os.path.join(root, f),
                 os.path.relpath(os.path.join(root, f), folder))
                for root, _, names in os.walk(folder) for f in names)


def step_module_files(dump_dir: str) -> list[tuple[str, str]]:
  """The files of the largest module in an XLA dump (the train step):
  names start module_NNNN.; [(path, name)], largest module only."""
  modules = {}
  for disk, name in _tree(dump_dir):
    match = re.match(r"(module_\d+)\.", os.path.basename(name))
    if match:
      modules.setdefault(match.group(1), []).append((disk, name))
  if not modules:
    return []
  return max(modules.values(),
             key=lambda fs: sum(os.path.getsize(d) for d, _ in fs))


def pack_dump(files, path: str, cap: int = MAX_ARCHIVE_BYTES) -> dict:
  """The dump's files packed under cap: all of them, else the HLO text
  after and before optimization, else after optimization only."""
  tiers = (lambda n: True,
           lambda n: "optimizations" in n and n.endswith(".txt"),
           lambda n: "after_optimizations" in n and n.endswith(".txt"))
  for keep in tiers:
    chosen = [(d, n) for d, n in files if keep(os.path.basename(n))]
    size = _pack(path, chosen)
    if size <= cap:
      return {"dump_files": len(chosen), "dump_bytes": size}
  os.remove(path)
  return {"dump_error": f"even the optimized HLO packs to {size} bytes > "
                        f"{cap}"}


def stage_profile(results: Results, out: str, work: str,
                  build_step) -> None:
  """Three steps of build_step()'s train step traced, the trace packed into
  OUT, then the XLA dump of the step (where dump_flags were set)."""
  # Here, not above: the driver reads dump_flags without importing JAX.
  import jax  # pylint: disable=g-import-not-at-top
  from lab.benchmarks import traces  # pylint: disable=g-import-not-at-top
  got = build_step()
  trace_dir = tempfile.mkdtemp(prefix="zebra_profile_trace_", dir=work)
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for i in range(3):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        jax.block_until_ready(got["run"](i))
  archive = os.path.join(out, TRACE_ARCHIVE)
  size = _pack(archive, _tree(trace_dir))
  found = {"trace_archive": TRACE_ARCHIVE, "trace_bytes": size,
           "tensorboard": tensorboard_command()}
  if size > MAX_ARCHIVE_BYTES:
    os.remove(archive)
    found = {"error": f"the trace packs to {size} bytes > "
                      f"{MAX_ARCHIVE_BYTES}"}
  try:
    summary = traces.summarise_trace(trace_dir, got["compiled"].as_text())
    found["share"] = summary.get("share", {})
    if "error" in summary:
      found["share_error"] = summary["error"]
  except Exception as e:  # pylint: disable=broad-except
    found["share_error"] = first_error_line(e)
  results.update("profile", found)
  dump_dir = os.path.join(work, DUMP_DIR)
  files = step_module_files(dump_dir) if os.path.isdir(dump_dir) else []
  if not files:
    results.update("profile", {"dump_error": "no XLA dump (XLA_FLAGS had no "
                                             "--xla_dump_to)"}, rows=0)
    return
  packed = pack_dump(files, os.path.join(out, DUMP_ARCHIVE))
  if "dump_files" in packed:
    packed["dump_archive"] = DUMP_ARCHIVE
  results.update("profile", packed)
