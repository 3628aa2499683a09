"""`zebra-jax --help`: the command's flags grouped by the mode that reads them.

A flag's group is the `mode:` its help text starts with ("sample: text to
continue"), so the grouping is read off the definitions in main.py; flags
without one apply to every mode. Exits 0, unlike absl's short help.
"""

import re
import textwrap

from absl import flags

from zebra_jax.cli.modes import MODES

MODE_PREFIX = re.compile(r"^(\w+): ")
SUMMARY = """\
zebra-jax: train, evaluate, sample, score, export, serve and plot ZebraLSTM
language models. The same command as python -m zebra_jax.main.

usage: zebra-jax --config=NAME[:variant] [--workdir=DIR] [--config.section.field=VALUE ...]
       zebra-jax --workdir=DIR --mode=MODE [flags of that mode]
       zebra-jax fields [SECTION]   every config field: default, rule, meaning

e.g.   zebra-jax --config=demo                       # train into runs/demo
       zebra-jax --workdir=runs/demo --mode=sample --prompt="The module"
"""
FOOTER = """\
Every number is a config field, set with --config.section.field=VALUE.
More: --helpfull (every flag, absl's too); zebra-jax fields [SECTION] (every \
config field's default, rule and meaning, from zebra_jax/config/base.py)"""
CHOICES = re.compile(r"^<([^>]*)>: ")
REPEATABLE = re.compile(r";\s+repeat this option to specify a list of values$")


def text(program_flags: list[str], process_flags: list[str]) -> str:
  """The help: usage, then every mode's flags (by name), the multi-process
  flags, then where the rest is."""
  groups: dict[str, list[str]] = {"every mode": [], **{m: [] for m in MODES}}
  for name in program_flags:
    flag = flags.FLAGS[name]
    doc = REPEATABLE.sub("", CHOICES.sub("", flag.help))
    match = MODE_PREFIX.match(doc)
    group = match.group(1) if match else "every mode"
    groups.setdefault(group, []).append(_line(flag, doc[match.end():]
                                              if match else doc))
  groups["several processes (train)"] = [
      _line(flags.FLAGS[name], flags.FLAGS[name].help)
      for name in process_flags]
  out = [SUMMARY]
  for group, lines in groups.items():
    if not lines:
      continue
    out.append(f"{group}:")
    out.extend(lines)
    out.append("")
  out.append(FOOTER)
  return "\n".join(out)


def _line(flag, doc: str) -> str:
  choices = CHOICES.match(flag.help)
  name = f"--{flag.name}" + (f"=<{choices.group(1)}>" if choices else "")
  default = "" if flag.default in (None, "", [], False) else (
      f" (default {flag.default_as_str})")
  return textwrap.fill(f"{name}: {doc}{default}", 79,
                       initial_indent="  ", subsequent_indent="      ")
