"""Every command README.md, docs/ and lab/notes/ show names what exists
(tests/docs_commands.py).

The checker itself is tested on small pages that break each rule once, so a
clean report on the real pages means the rules ran.
"""

import os
import re

import pytest

from tests import docs_commands

# Findings on pages being rewritten apart from this test, without their line
# numbers (which move as the pages change); each is to go when its page is
# fixed (the test fails while one is listed here but no longer found).
PENDING: set[str] = set()  # findings to fix, matched without line numbers


def test_the_pages_commands_name_what_exists():
  findings = {re.sub(r"^([^:]+):\d+: ", r"\1: ", finding)
              for finding in docs_commands.check_repository()}
  assert findings - PENDING == set()
  assert PENDING - findings == set(), "fixed: remove them from PENDING"


def _page(*lines: str) -> str:
  return "\n".join(["# A page", "", "```bash", *lines, "```", ""])


def test_a_good_page_has_no_findings():
  page = _page(
      "zebra-jax --config=demo:tiny --workdir=runs/t --config.train.num_steps=5",
      'W="--workdir=runs/t"',
      "zebra-jax $W --mode=eval --split=test",
      "zebra-jax $W --mode=plot --compare=runs/t",
      'python3 -m pip install -e ".[test]" && python3 -m pytest',
      "bash launch/gpu_report.sh --dry-run --no-install smoke",
      "launch/compare_stripes.sh char --resume --no_classic",
      "python -m lab.train_bench --stripes=8 --config.model.recurrence=native")
  assert docs_commands.check_page(page + "From the repository root.") == []


@pytest.mark.parametrize("line, complaint", [
    ("zebra-jax --config=demo --temprature=0", "--temprature: zebra-jax "
     "defines no such flag"),
    ("zebra-jax --config=demo --config.model.num_stripe=8",
     "no field model.num_stripe in zebra_jax/config/base.py"),
    ("zebra-jax --config=demoo", "--config=demoo:"),
    ("zebra-jax --mode=eval --workdir=runs/never", "reads runs/never, which "
     "no earlier command on the page trains"),
    ("zebra-jax --config=demo --workdir=runs/a --mode=plot "
     "--compare=runs/b", "reads runs/b"),
    ("python -m lab.no_such_script", "python -m lab.no_such_script: no such "
     "module"),
    ("python -m lab.serve_bench --workdir=runs/x --clientz=4", "--clientz: "
     "lab/serve_bench.py defines no such flag"),
    ("python -m zebra_jax.main --config=demo --text_file=docs/missing.txt",
     "docs/missing.txt: no such file"),
    ("launch/no_such.sh char", "launch/no_such.sh: no such script"),
    ("launch/compare_stripes.sh char --stripez=8", "--stripez: "
     "launch/compare_stripes.sh defines no such flag"),
    ('pip install -e ".[no_such_extra]"', "defines no such extra"),
])
def test_a_bad_command_is_found(line, complaint):
  findings = docs_commands.check_page(
      _page(line) + "\nRun the lab from the repository root.\n")
  assert any(complaint in finding for finding in findings), findings


def test_a_workdir_trained_later_on_the_page_is_found():
  findings = docs_commands.check_page(_page(
      "zebra-jax --config=demo --workdir=runs/demo",
      "zebra-jax --workdir=runs/demo --mode=plot --compare=runs/s8",
      "zebra-jax --config=demo --workdir=runs/s8"), "README.md")
  assert findings == ["README.md:5: reads runs/s8, which no earlier command "
                      "on the page trains (add the command that does, or a "
                      "comment '# runs/s8 comes from ...')"]


def test_a_declared_workdir_needs_no_training_on_the_page():
  page = _page("# runs/demo comes from the quickstart (README.md)",
               "zebra-jax --workdir=runs/demo --mode=eval")
  assert docs_commands.check_page(page) == []


def test_lab_commands_need_the_working_directory_on_the_page():
  page = _page("python -m lab.data_bench --quick")
  assert docs_commands.check_page(page, "p.md") == [
      "p.md:4: the lab's commands run from the repository root, and the page "
      "does not say so (\"from the repository root\")"]
  assert docs_commands.check_page(
      page + "Run it from the repository root.") == []


def test_console_blocks_check_only_prompted_lines():
  page = "```console\n$ zebra-jax --bogus\nerror: --bogus\n```\n"
  assert docs_commands.check_page(page) == [
      "page:2: --bogus: zebra-jax defines no such flag"]


def test_ci_runs_the_readmes_test_command_as_written():
  """The quickstart (the README's first shell block) says CI runs exactly
  its test command: .ci/run holds that line verbatim."""
  with open(os.path.join(docs_commands.REPO, "README.md"),
            encoding="utf-8") as f:
    quickstart = f.read().split("```bash\n", 2)[1].split("```")[0]
  commands = [line for line in quickstart.splitlines()
              if line.startswith("python3 -m pip install")]
  assert len(commands) == 2, quickstart
  with open(os.path.join(docs_commands.REPO, ".ci", "run"),
            encoding="utf-8") as f:
    ci = f.read().splitlines()
  assert commands[1] == 'python3 -m pip install -e ".[test]" && python3 -m pytest'
  assert commands[1] in ci
