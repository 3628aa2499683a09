"""`zebra-jax fields [SECTION]`: every config field's default, rule and meaning.

Printed from the one registry (config/base.py), so the list cannot differ
from what a --config.section.field=value override is checked against.
"""

import sys

from zebra_jax.config import base, rules

USAGE = "usage: zebra-jax fields [SECTION]"


def describe(rule) -> str:
  """What a field may hold, in words, read off its rule."""
  if isinstance(rule, rules.OneOf):
    return "one of " + ", ".join(map(str, rule.choices))
  if isinstance(rule, rules.Checked):
    message = rule.problem("?")
    return message.split(", e.g.")[0] if message else "any value"
  if rule is rules.CHECKED_WITH_OTHERS:
    return "checked against the fields it depends on"
  return rule.requirement


def sections() -> list[str]:
  return [key for key, value in base.FIELDS.items() if isinstance(value, dict)]


def listing(section: str | None = None) -> list[str]:
  """Three lines a field: `name = default`, its rule, its meaning."""
  out = []
  for name, field in base.fields():
    if section and not name.startswith(section + "."):
      continue
    out += [f"{name} = {field.default!r}", f"    {describe(field.rule)}",
            f"    {field.doc}"]
  return out


def main(args: list[str]) -> int:
  """Prints the fields of SECTION (all without one); 2 for a bad SECTION."""
  if args and args[0] in ("-h", "--help", "-help"):
    print(f"{USAGE}\nSections: {', '.join(sections())}.")
    return 0
  if len(args) > 1 or (args and args[0] not in sections()):
    print(f"error: {' '.join(args)!r} is not a config section: name one of "
          f"{', '.join(sections())} ({USAGE})", file=sys.stderr)
    return 2
  print("\n".join(listing(args[0] if args else None)))
  return 0
