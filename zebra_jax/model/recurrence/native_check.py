"""Whether a native time-loop library may be loaded, read from its bytes
before it is.

Why before: loading is where a bad library kills the process. One cut short
(a build or a copy killed half way, a full disk) dies of SIGBUS when its
pages are mapped; one built for CPU features this CPU lacks (a library from
a newer node in a shared home) dies of SIGILL at its first call; any other
shared library has no entry points. Each is a reason here, and the layer
runs the scan instead.

What is read: the record its build wrote beside it (`<library>.json`: size
and SHA-256), the ELF headers (every segment and the section table inside
the file, the machine this CPU is), and the build record native.cc compiles
into the library (`ZebraNativeBuild`: the source's digest, the vector ISA,
the CPU features the compiler was allowed to use, in /proc/cpuinfo's names).
"""

import hashlib
import json
import pathlib
import platform
import re
import struct

RECORD_SUFFIX = ".json"
_BUILD_RECORD = re.compile(
    rb"zebra-native-build source=(\w+) isa=(\w+) needs=([\w ]*);")
_ELF_MACHINES = {62: "x86_64", 183: "aarch64", 243: "riscv64"}
_MACHINE_ALIASES = {"AMD64": "x86_64", "arm64": "aarch64"}


def cpu_features_line() -> str:
  """/proc/cpuinfo's first flags line (x86) or Features line (aarch64);
  "" where there is none."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line.rstrip("\n")
  except OSError:
    pass
  return ""


def cpu_flags() -> frozenset[str]:
  """This CPU's own feature flags (empty where the system does not list
  them: then no library is refused for its ISA)."""
  line = cpu_features_line()
  return frozenset(line.split(":", 1)[1].split()) if ":" in line else (
      frozenset())


def record_path(library: pathlib.Path) -> pathlib.Path:
  return library.with_name(library.name + RECORD_SUFFIX)


def record_of(data: bytes) -> str:
  """The record a build writes beside its library, as JSON text."""
  return json.dumps({"size": len(data),
                     "sha256": hashlib.sha256(data).hexdigest()}) + "\n"


def read_record(library: pathlib.Path) -> dict | None:
  """The library's build record; None where there is none; {} where it
  cannot be read (which no library then matches)."""
  try:
    record = json.loads(record_path(library).read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) else {}


def damage(data: bytes, record: dict | None) -> str:
  """Why `data` is not the whole library its build wrote ("" when it is):
  against the build's record where there is one, and against its own ELF
  headers always."""
  if record is not None:
    size = record.get("size")
    if not isinstance(size, int) or not isinstance(record.get("sha256"), str):
      return "its build record is unreadable"
    if size != len(data):
      return f"{len(data):,} bytes where its build wrote {size:,}"
    if record["sha256"] != hashlib.sha256(data).hexdigest():
      return "its checksum is not the one its build recorded"
  return _elf_damage(data)


def _elf_damage(data: bytes) -> str:
  """A 64-bit little-endian ELF shared library whose segments and section
  table all lie inside it ("" when so), for whichever CPU: a cross build is
  whole too."""
  if not data:
    return "the file is empty"
  if len(data) < 64 or data[:4] != b"\x7fELF":
    return "not a shared library (no ELF header)"
  if data[4] != 2 or data[5] != 1:
    return "not a 64-bit little-endian library"
  (kind,) = struct.unpack_from("<H", data, 16)
  (phoff, shoff) = struct.unpack_from("<QQ", data, 32)
  (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", data, 54)
  if kind != 3:  # ET_DYN
    return "not a shared library (an ELF file of another kind)"
  if not phnum or phentsize < 56 or phoff + phnum * phentsize > len(data):
    return f"cut short ({len(data):,} bytes: its program headers are missing)"
  for i in range(phnum):
    offset, filesz = struct.unpack_from("<Q16xQ", data,
                                        phoff + i * phentsize + 8)
    if offset + filesz > len(data):
      return (f"cut short ({len(data):,} bytes where its segments need "
              f"{offset + filesz:,})")
  if shnum and shoff + shnum * shentsize > len(data):
    return (f"cut short ({len(data):,} bytes where its section table ends "
            f"at {shoff + shnum * shentsize:,})")
  return ""


def build_info(data: bytes) -> tuple[str, str, frozenset[str]] | None:
  """(source digest, vector ISA, CPU features it needs) from the record
  native.cc compiles in; None for a library without one."""
  match = _BUILD_RECORD.search(data)
  if match is None:
    return None
  source, isa, needs = (g.decode() for g in match.groups())
  return source, isa, frozenset(needs.split())


def _machine(data: bytes) -> str:
  """The CPU architecture an ELF file (already checked whole) is for."""
  (machine,) = struct.unpack_from("<H", data, 18)
  return _ELF_MACHINES.get(machine, f"ELF machine {machine}")


def unfit(data: bytes, source_digest: str, flags: frozenset[str]) -> str:
  """Why this CPU must not load the (whole) library ("" when it may):
  another architecture's, no build record (not a zebra_jax library, or one
  too old to say), another source's build, or CPU features it was built
  for and `flags` lack."""
  here = _MACHINE_ALIASES.get(platform.machine(), platform.machine())
  if here in _ELF_MACHINES.values() and _machine(data) != here:
    return f"it was built for {_machine(data)}, not this {here} CPU"
  info = build_info(data)
  if info is None:
    return "it is not a zebra_jax native library (it has no build record)"
  source, _, needs = info
  if source != source_digest:
    return "it was built from another version of native.cc"
  missing = sorted(needs - flags) if flags else []
  if missing:
    return ("it was built for CPU features this CPU lacks "
            f"({' '.join(missing)})")
  return ""
