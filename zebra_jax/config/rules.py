"""What a config field may hold, and the one line that says how to fix it.

A `Field` in config/base.py carries its default, its rule and its comment, so
validation is read off the definitions rather than naming the fields again.
"""

import dataclasses
import math
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Rule:
  """A test on a value, what a failing value is told, and a good example."""
  test: Callable[[Any], bool]
  requirement: str
  example: str

  def error(self, name: str, value) -> str | None:
    """None for a good value, else one line naming the field and the fix."""
    if self.test(value):
      return None
    return (f"--config.{name}={value!r} {self.requirement}: set it to e.g. "
            f"{self.example}")


@dataclasses.dataclass(frozen=True)
class OneOf:
  """A value from a fixed list (a registry's names, a model's kinds)."""
  choices: tuple

  def error(self, name: str, value) -> str | None:
    if value in self.choices:
      return None
    return (f"--config.{name}={value!r} is not one of "
            f"{', '.join(self.choices)}: pick one of those")


@dataclasses.dataclass(frozen=True)
class Checked:
  """A value judged by a check defined elsewhere (`problem(value)` -> what
  is wrong, or None): the sampling parameters' bounds live with them."""
  problem: Callable[[Any], str | None]

  def error(self, name: str, value) -> str | None:
    message = self.problem(value)
    return None if message is None else f"--config.{name}={value!r} {message}"


@dataclasses.dataclass(frozen=True)
class Field:
  """A config field: its default, what it may hold, and what it means."""
  default: Any
  rule: Rule | OneOf | Checked
  doc: str


def one_of(choices) -> OneOf:
  return OneOf(tuple(choices))


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return (isinstance(v, (int, float)) and not isinstance(v, bool)
          and math.isfinite(v))


POSITIVE_INT = Rule(lambda v: _is_int(v) and v > 0,
                    "must be a positive whole number", "1")
NON_NEGATIVE_INT = Rule(lambda v: _is_int(v) and v >= 0,
                        "must be a whole number >= 0", "0")
INT = Rule(_is_int, "must be a whole number", "0")
POSITIVE = Rule(lambda v: _is_number(v) and v > 0, "must be positive", "1e-3")
NON_NEGATIVE = Rule(lambda v: _is_number(v) and v >= 0,
                    "must be a number >= 0", "0")
RATE = Rule(lambda v: _is_number(v) and 0 <= v < 1, "is outside [0, 1)",
            "0.1 (0 = off)")
RATIO = Rule(lambda v: _is_number(v) and 0 <= v <= 1, "is outside [0, 1]",
             "0.1")
SHRINK_FACTOR = Rule(lambda v: _is_number(v) and 0 < v < 1,
                     "is outside (0, 1)", "0.5")
GROWTH_FACTOR = Rule(lambda v: _is_number(v) and v > 1, "must be above 1",
                     "2.0")
FRACTION = Rule(lambda v: _is_number(v) and 0 < v < 0.5, "is outside (0, 0.5)",
                "0.05 (hold out a small share)")
PROBABILITY_MASS = Rule(lambda v: _is_number(v) and 0 < v <= 1,
                        "is outside (0, 1]", "0.95 (1 = off)")
BOOL = Rule(lambda v: isinstance(v, bool), "must be true or false", "true")
TEXT = Rule(lambda v: isinstance(v, str), "must be text", "''")
# Checked together with the field that gives it meaning (config_checks).
CHECKED_WITH_OTHERS = Rule(lambda v: True, "", "")
