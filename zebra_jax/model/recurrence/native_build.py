"""Building the native time loops' library, caching it, and whether one
may be loaded: the compiler's side of `native.py`, which loads it.

The sources (native_cc/: native.cc and the headers it includes, one
translation unit) are compiled on first use with the machine's C++ compiler
($CXX, else c++ or g++) against the XLA FFI headers that jaxlib ships, for
this CPU (-march=native; $ZEBRA_JAX_NATIVE_MARCH names another target, e.g.
x86-64-v3 for any AVX2 machine), and the library is cached under
$XDG_CACHE_HOME/zebra_jax/kernels (default ~/.cache; a private temporary
folder where that cannot be written), keyed by every source file, the
compiler, jax's version, the flags and, for -march=native, the CPU's
features. A failed build is remembered there under the same key, so other
processes do not retry it (not a compiler killed by a signal: out of
memory is no verdict on the source). Ahead of time, on a machine with a
compiler:

  python3 -m zebra_jax.model.recurrence.native --build [--march=M] [--out=F]

and ZEBRA_JAX_NATIVE_LIB=F on a node without one loads that library. A
build writes a record of the library beside it (F.json: size, SHA-256);
before a library is loaded, `native_check.py` checks it against that record,
its ELF headers and the CPU features it was built for (refusal): a damaged
cached library is rebuilt, a damaged or foreign prebuilt one, or one built
for features this CPU lacks, is refused (loading it would kill the process).
"""

import argparse
import hashlib
import logging
import os
import pathlib
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile

import jax

from zebra_jax.errors import UserError
from zebra_jax.model.recurrence import native_check

SOURCE = pathlib.Path(__file__).with_name("native_cc") / "native.cc"
MARCH_ENV, LIB_ENV = "ZEBRA_JAX_NATIVE_MARCH", "ZEBRA_JAX_NATIVE_LIB"
_COMPILE_TIMEOUT_S = 600
BUILD_COMMAND = "python3 -m zebra_jax.model.recurrence.native --build"


def march() -> str:
  """The -march the library is built for: $ZEBRA_JAX_NATIVE_MARCH, else
  this CPU's (native)."""
  return os.environ.get(MARCH_ENV) or "native"


def sources() -> list[pathlib.Path]:
  """Every file of the one compile: native.cc and the headers it includes."""
  return sorted(p for p in SOURCE.parent.iterdir()
                if p.suffix in (".cc", ".h"))


def _source_text() -> bytes:
  """The sources, each under its name: what the digest and the cache key
  read, so that an edit to any of them is another build."""
  return b"".join(p.name.encode() + b"\n" + p.read_bytes() + b"\n"
                  for p in sources())


def source_digest() -> str:
  """The sources' digest, compiled into the library: a prebuilt library
  from another version of them (other FFI signatures) is refused."""
  return hashlib.sha256(_source_text()).hexdigest()[:16]


def flags(target: str) -> tuple[str, ...]:
  """The compiler's flags for -march=target (checked: it goes into argv)."""
  if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", target):
    raise UserError(f"{MARCH_ENV}={target!r} is not a -march value: use e.g. "
                    "native, x86-64-v3, x86-64 or armv8-a")
  return ("-O3", f"-march={target}", "-ffp-contract=fast", "-std=c++17",
          "-shared", "-fPIC", "-pthread", "-w",
          f'-DZEBRA_NATIVE_SOURCE="{source_digest()}"')


def compiler() -> str | None:
  """The C++ compiler to build with: $CXX, else c++ or g++ on the PATH."""
  return (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
          or None)


def _user_cache() -> pathlib.Path | None:
  """$XDG_CACHE_HOME, else ~/.cache; None without a home (HOME unset and a
  uid with no passwd entry, where Path.home() raises)."""
  if root := os.environ.get("XDG_CACHE_HOME"):
    return pathlib.Path(root)
  home = os.environ.get("HOME")
  if not home:
    try:
      home = str(pathlib.Path.home())
    except (RuntimeError, KeyError, OSError):
      return None
  return pathlib.Path(home) / ".cache"


def _writable(folder: pathlib.Path, private=False) -> bool:
  """Creates folder if needed; whether this process can write into it (and,
  when private, whether only this uid can: a shared temporary folder must
  not hand us another user's library)."""
  try:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if private:
      info = folder.stat()
      if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP |
                                                       stat.S_IWOTH):
        return False
    with tempfile.TemporaryFile(dir=folder):
      pass
    return True
  except OSError:
    return False


def cache_dir() -> pathlib.Path:
  """Where libraries are cached: the user's cache, else (no home, or not
  writable) a private folder under the temporary directory."""
  user = _user_cache()
  if user is not None and _writable(user / "zebra_jax" / "kernels"):
    return user / "zebra_jax" / "kernels"
  uid = os.getuid() if hasattr(os, "getuid") else 0
  fallback = pathlib.Path(tempfile.gettempdir()) / f"zebra_jax-{uid}"
  if not _writable(fallback, private=True):
    raise OSError(f"no writable cache: {user or '(no home)'} nor {fallback}")
  (fallback / "kernels").mkdir(exist_ok=True)
  return fallback / "kernels"


def cpu_features() -> str:
  """The CPU's feature flags: -march=native code is only valid on a CPU
  that has them all (a cache shared between machines)."""
  return native_check.cpu_features_line() or platform.processor()


def first_error(output: str) -> str:
  """The compiler's first `error:` line (the cause; later lines are its
  consequences and source excerpts), else its last non-empty line."""
  lines = [l.strip() for l in output.splitlines() if l.strip()]
  errors = [l for l in lines if "error:" in l]
  return (errors or lines[-1:] or ["no output"])[0]


class BuildError(Exception):
  """The library could not be built: the message is one line."""


# What a compiler driver prints when the signal that ended the compile was
# not its own verdict (g++: "Killed signal terminated program cc1plus";
# older g++: "internal compiler error: Killed (program cc1plus)"; clang:
# "unable to execute command: Killed", "... failed due to signal").
_KILLED = re.compile(r"signal terminated program|\(program \w+\)|"
                     r"unable to execute command|due to signal")


def killed(returncode: int, output: str) -> bool:
  """Whether a failed compile was ended by a signal (the OOM killer, a
  timeout) rather than refused by the compiler: not worth remembering."""
  return returncode < 0 or returncode >= 128 or bool(_KILLED.search(output))


def build(cxx: str, target: str, out: pathlib.Path | None = None
          ) -> pathlib.Path:
  """Compiles SOURCE for -march=target unless a library for this source,
  compiler, jax, flags (and, for native, CPU) is cached, or a build of it
  failed before; returns its path (out: build there, no cache). cxx may hold
  words ("ccache g++"), as $CXX often does. Raises BuildError."""
  return _build(cxx, target, out)[0]


def _build(cxx: str, target: str, out: pathlib.Path | None = None
           ) -> tuple[pathlib.Path, bool]:
  """build(), and whether it compiled now (False: the cached library)."""
  command = shlex.split(cxx)
  try:
    version = subprocess.run([*command, "--version"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise BuildError(f"no usable C++ compiler ({cxx}: "
                     f"{getattr(e, 'strerror', None) or e})") from e
  build_flags = flags(target)
  key = hashlib.sha256(_source_text() + "\n".join(
      [cxx, version, jax.__version__, " ".join(build_flags),
       cpu_features() if target == "native" else ""]).encode()
                       ).hexdigest()[:20]
  folder = cache_dir() if out is None else out.parent
  path = out or folder / f"native_recurrence_{key}.so"
  failed = folder / f"native_recurrence_{key}.failed"
  if out is None and path.exists():
    why = _cached_damage(path)
    if not why:
      return path, False
    logging.warning("the cached %s is damaged (%s): compiling it again",
                    path, why)
  elif out is None and failed.exists():
    raise BuildError(f"{failed.read_text().strip()} (an earlier build; "
                     f"delete {failed} to retry)")
  folder.mkdir(parents=True, exist_ok=True)
  logging.warning("compiling %s for -march=%s (once: about 10 s)",
                  SOURCE.name, target)
  # Built beside its final name and renamed, its record first: processes
  # that build at the same time each rename a complete library, and one cut
  # short leaves only its temporary folder.
  with tempfile.TemporaryDirectory(dir=folder) as tmp:
    built = pathlib.Path(tmp) / path.name
    try:
      subprocess.run([*command, *build_flags, f"-I{jax.ffi.include_dir()}",
                      str(SOURCE), "-o", str(built)], capture_output=True,
                     text=True, check=True, timeout=_COMPILE_TIMEOUT_S)
    except subprocess.CalledProcessError as e:
      output = e.stderr + e.stdout
      why = (f"compiling {SOURCE.name} for -march={target} failed: "
             f"{first_error(output)}")
      # Remembered (atomically, as the library is) where the compiler
      # itself refused; not a compiler killed by a signal (out of memory).
      if out is None and not killed(e.returncode, output):
        note = pathlib.Path(tmp) / failed.name
        note.write_text(why + "\n")
        os.replace(note, failed)
      raise BuildError(why) from e
    except (OSError, subprocess.SubprocessError) as e:
      raise BuildError(f"running {cxx} failed: {e}") from e
    data = built.read_bytes()
    if why := native_check.damage(data, None):
      raise BuildError(f"compiling {SOURCE.name} for -march={target} wrote "
                       f"no usable library: {why}")
    record = pathlib.Path(tmp) / native_check.record_path(path).name
    record.write_text(native_check.record_of(data))
    os.replace(record, native_check.record_path(path))
    os.replace(built, path)
  return path, True


def _cached_damage(path: pathlib.Path) -> str:
  """Why the cached library is not the one its build wrote ("" when it
  is); a library without its build's record counts as damaged."""
  try:
    data = path.read_bytes()
  except OSError as e:
    return e.strerror or str(e)
  record = native_check.read_record(path)
  if record is None:
    return "no record of its build beside it"
  return native_check.damage(data, record)


def library_path() -> tuple[pathlib.Path, str]:
  """The library this process loads, and where it comes from:
  $ZEBRA_JAX_NATIVE_LIB (made absolute), else one built now or cached for
  march(). Raises BuildError."""
  if prebuilt := os.environ.get(LIB_ENV):
    return pathlib.Path(prebuilt).expanduser().resolve(), LIB_ENV
  cxx = compiler()
  if cxx is None:
    raise BuildError("no C++ compiler found (install g++, set CXX, or point "
                     f"{LIB_ENV} at a library built with `{BUILD_COMMAND}`)")
  path, compiled = _build(cxx, march())
  return path, "compiled now" if compiled else "cached"


def refusal(path: pathlib.Path, origin: str, data: bytes) -> str:
  """Why this library must not be loaded here, with the fix ("" when it
  may be loaded)."""
  if origin == LIB_ENV:
    name = f"{LIB_ENV}={path}"
    if why := native_check.damage(data, native_check.read_record(path)):
      return (f"{name} is damaged ({why}): copy it again, or rebuild it "
              f"with `{BUILD_COMMAND} --out=F`")
  else:
    name = f"the library for -march={march()} ({path})"
  why = native_check.unfit(data, source_digest(), native_check.cpu_flags())
  if not why:
    return ""
  if origin == LIB_ENV:
    fix = (f"build one for this CPU with `{BUILD_COMMAND} --march=M "
           f"--out=F` (M: native, or x86-64-v3 for any AVX2 CPU), or unset "
           f"{LIB_ENV}")
  else:
    fix = f"set {MARCH_ENV} to a target this CPU runs, e.g. native"
  return f"{name}: {why}; {fix}"


def main(argv=None) -> int:
  """`--build`: compiles the library ahead of time (for a node without a
  compiler: copy it there and set ZEBRA_JAX_NATIVE_LIB)."""
  parser = argparse.ArgumentParser(
      prog="python3 -m zebra_jax.model.recurrence.native",
      description="Build the native CPU time loops ahead of time.")
  parser.add_argument("--build", action="store_true", required=True,
                      help="compile the library (or find it in the cache)")
  parser.add_argument("--march", default=None,
                      help=f"-march target (default ${MARCH_ENV} or native; "
                      "x86-64-v3 runs on any AVX2 x86-64)")
  parser.add_argument("--out", default=None,
                      help="write the library here instead of the cache")
  args = parser.parse_args(argv)
  target = args.march or march()
  try:
    cxx = compiler()
    if cxx is None:
      raise UserError("no C++ compiler found: install g++ or set CXX")
    path = build(cxx, target,
                 pathlib.Path(args.out).resolve() if args.out else None)
  except (BuildError, OSError, UserError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(path)
  print(f"use it where there is no compiler: {LIB_ENV}={path} (copy "
        f"{native_check.record_path(path).name} with it: the loader checks "
        "the copy against it)", file=sys.stderr)
  return 0
