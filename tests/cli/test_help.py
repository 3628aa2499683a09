"""zebra-jax --help (the flags by mode, exit 0) and zebra-jax fields (every
config field from the one registry, config/base.py)."""

import subprocess
import sys

from zebra_jax.cli import fields
from zebra_jax.config import base


def _zebra_jax(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "zebra_jax.main", *args],
                        capture_output=True, text=True, timeout=120)


def test_help_exits_0_grouped_by_mode_ending_with_where_the_rest_is():
  result = _zebra_jax("--help")
  assert result.returncode == 0, result.stderr
  out = result.stdout
  for group in ("every mode:", "sample:", "score:", "eval:", "serve:",
                "plot:", "export:"):
    assert f"\n{group}\n" in out
  assert out.index("\nsample:\n") < out.index("--prompt_file") < out.index(
      "\nscore:\n")
  last = out.rstrip().splitlines()[-1]
  assert "--helpfull" in last and "zebra-jax fields" in last
  assert "config/base.py" in last


def test_fields_prints_every_field_with_default_rule_and_meaning():
  result = _zebra_jax("fields")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  registry = list(base.fields())
  assert len(lines) == 3 * len(registry)
  for i, (name, field) in enumerate(registry):
    assert lines[3 * i] == f"{name} = {field.default!r}"
    assert lines[3 * i + 2].strip() == field.doc


def _rules(section: str) -> dict[str, str]:
  listed = fields.listing(section)
  names = [line.split(" = ")[0] for line in listed[::3]]
  assert names == [n for n, _ in base.fields() if n.startswith(section + ".")]
  return dict(zip(names, (line.strip() for line in listed[1::3])))


def test_fields_of_one_section_and_each_rule_in_words():
  assert fields.listing("sample")[0] == "sample.prompt = 'The '"
  assert _rules("sample")["sample.temperature"] == (
      "must be a number in [0, 100]")
  model = _rules("model")
  assert model["model.num_layers"] == "must be a positive whole number"
  assert model["model.stripe_input"] == "one of dense, grouped"
  assert model["model.adaptive_cutoffs"] == (
      "checked against the fields it depends on")


def test_an_unknown_section_is_one_error_line_and_exit_2():
  result = _zebra_jax("fields", "modle")
  assert result.returncode == 2
  assert result.stdout == ""
  assert result.stderr.startswith("error: 'modle' is not a config section")
  assert len(result.stderr.splitlines()) == 1


# Reads what the program imported, after its own exit: the mode's help or
# the field list, then whether JAX is among the modules.
_IMPORTS_AFTER = """
import runpy, sys
sys.argv = ["zebra-jax"] + sys.argv[1:]
try:
  runpy.run_module("zebra_jax.main", run_name="__main__")
except SystemExit:
  pass
print("jax imported:", "jax" in sys.modules, file=sys.stderr)
"""


def test_help_and_fields_start_no_jax():
  """Reading a flag or a field costs no JAX start-up (seconds on a CPU)."""
  for args in (["--help"], ["fields"], ["fields", "sample"],
               ["--mode=serve", "--help"]):
    result = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *args],
                            capture_output=True, text=True, timeout=120)
    assert "jax imported: False" in result.stderr, (args, result.stderr[-500:])
  # The check itself sees JAX where a mode runs.
  result = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER + (
      "import zebra_jax.engine as e; e.Engine\n"
      "print('after the scheduler:', 'jax' in sys.modules, file=sys.stderr)")
  ], capture_output=True, text=True, timeout=120)
  assert "after the scheduler: True" in result.stderr, result.stderr[-500:]
