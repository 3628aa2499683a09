"""--config.a.b=v on the command line, applied to a loaded config.

Overrides are parsed once, against the config they change (a config file's
or a workdir's config.json), so every mode takes them the same way. A value
is read as the type the field holds; an unknown field or a value of the
wrong type is one UserError line.
"""

import ast
import re

import ml_collections

from zebra_jax.errors import UserError

_OVERRIDE = re.compile(r"^--?(no)?config\.([A-Za-z0-9_.]+)(?:=(.*))?$",
                       re.DOTALL)
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def split(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
  """(argv without the overrides, [(dotted field, text or None)]).

  --config.x=v and --config.x v give "v"; a bare --config.x gives None
  (true, for a bool field); --noconfig.x gives "false".
  """
  rest, found, i = [], [], 0
  while i < len(argv):
    arg = argv[i]
    match = _OVERRIDE.match(arg) if arg != "--" else None
    if arg == "--":
      rest += argv[i:]
      break
    if not match:
      rest.append(arg)
    elif match.group(1):
      found.append((match.group(2), "false"))
    elif match.group(3) is not None:
      found.append((match.group(2), match.group(3)))
    elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
      found.append((match.group(2), argv[i + 1]))
      i += 1
    else:
      found.append((match.group(2), None))
    i += 1
  return rest, found


def apply(cfg: ml_collections.ConfigDict,
          overrides: list[tuple[str, str | None]]) -> ml_collections.ConfigDict:
  """cfg with every override set (in order); UserError for a bad one."""
  for dotted, text in overrides:
    parts = dotted.split(".")
    node = cfg
    for depth, part in enumerate(parts):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        where = ".".join(parts[:depth]) or "the config"
        valid = (", ".join(sorted(node.keys()))
                 if isinstance(node, ml_collections.ConfigDict) else "none")
        raise UserError(f"--config.{dotted}: {where} has no field {part!r}; "
                        f"valid fields: {valid}")
      if depth < len(parts) - 1:
        node = node[part]
    leaf = parts[-1]
    current = node[leaf]
    if isinstance(current, ml_collections.ConfigDict):
      raise UserError(f"--config.{dotted} is a section: set one of its "
                      f"fields, e.g. --config.{dotted}."
                      f"{sorted(current.keys())[0]}=...")
    value = _parse(dotted, text, current)
    with node.ignore_type():
      node[leaf] = value
  return cfg


def _parse(dotted: str, text: str | None, current):
  """text read as the type of the field's current value."""
  shown = f"--config.{dotted}" + ("" if text is None else f"={text}")
  if isinstance(current, bool):
    if text is None or text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise UserError(f"{shown} must be true or false")
  if text is None:
    raise UserError(f"--config.{dotted} needs a value: --config.{dotted}=...")
  try:
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
  except ValueError:
    kind = "a whole number" if isinstance(current, int) else "a number"
    raise UserError(f"{shown} must be {kind}, e.g. --config.{dotted}="
                    f"{current!r}") from None
  if isinstance(current, str):
    # A shell passes "\n" as two characters; sample texts and the chat
    # template mean a newline.
    if dotted.startswith("sample.") or dotted == "serve.chat_template":
      text = text.replace("\\n", "\n").replace("\\t", "\t")
    return text
  if isinstance(current, (tuple, list)):
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      raise UserError(f"{shown} is not a tuple: use e.g. --config.{dotted}="
                      f"'{tuple(current)!r}'") from None
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
  try:  # a field without a value to take the type from
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text
