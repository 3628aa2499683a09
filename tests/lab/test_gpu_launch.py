"""launch/gpu_report.sh's decisions and TensorBoard-less training.

The script runs in a copy of launch/ under a temporary folder with a fake
`python3` and `python` first on PATH: the fake records every call and answers
the jax probe as told, and fails loudly on a pip install of jax's CUDA
extras, so a script that would install on a node that already has its GPU
stack fails here.
"""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from lab.benchmarks import gpu_budget
from zebra_jax.runtime import writer
from tests.helpers import REPO

FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$FAKE_LOG"
if [[ "$1" == -c ]]; then
  case "$2" in
    *jax_cuda13_plugin*) echo "$FAKE_PROBE"; exit 0 ;;
    "import "*) for m in $FAKE_MISSING; do
                  [[ "$2" == "import $m" ]] && exit 1
                done; exit 0 ;;
  esac
  exit 0
fi
if [[ "$1 $2 $3" == "-m pip install" ]]; then
  if [[ "$*" == *cuda* || "$*" == *" -e "* ]]; then
    echo "FAKE PYTHON: pip install of the CUDA extras: $*" >&2
    exit 97
  fi
  exit 0
fi
exit 0
"""


def _fake_repo(tmp_path, wheels=(), python3=FAKE_PYTHON):
  """tmp/launch/gpu_report.sh (the real one), tmp/bin/python (the fake) and
  tmp/bin/python3 (the fake, or the script given)."""
  root = tmp_path / "repo"
  (root / "launch").mkdir(parents=True)
  shutil.copy(os.path.join(REPO, "launch", "gpu_report.sh"),
              root / "launch" / "gpu_report.sh")
  if wheels:
    (root / "wheels").mkdir()
    for name in wheels:
      (root / "wheels" / name).write_bytes(b"")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in (("python", FAKE_PYTHON), ("python3", python3)):
    fake = bin_dir / name
    fake.write_text(text)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  return root, bin_dir


def _run(tmp_path, *args, probe="0.11.2 jax_cuda13_plugin", missing="",
         wheels=(), env=None, python3=FAKE_PYTHON):
  root, bin_dir = _fake_repo(tmp_path, wheels, python3)
  log = tmp_path / "calls.log"
  environ = {k: v for k, v in os.environ.items()
             if k not in ("NO_INSTALL", "PYTHON", "OUT", "CUDA_EXTRA")}
  environ.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log),
                 FAKE_PROBE=probe, FAKE_MISSING=missing, **(env or {}))
  out = subprocess.run(["bash", str(root / "launch" / "gpu_report.sh"), *args],
                       capture_output=True, text=True, env=environ, timeout=60)
  calls = log.read_text().splitlines() if log.exists() else []
  return out, calls


def _report_calls(calls):
  return [c for c in calls if c.startswith("-m lab.gpu_report")]


def _pip_calls(calls):
  return [c for c in calls if c.startswith("-m pip")]


def test_gpu_jax_present_installs_nothing(tmp_path):
  out, calls = _run(tmp_path, "--dry-run", "bench", "wt103")
  assert out.returncode == 0, out.stderr
  assert "jax 0.11.2 with CUDA plugin found (jax_cuda13_plugin): " \
         "nothing installed" in out.stdout
  assert not _pip_calls(calls)
  report = _report_calls(calls)
  assert len(report) == 1
  args = report[0].split()
  assert "--stages=bench,wt103" in args and "--dry_run" in args
  assert not any(a.startswith("--stage=") or a == "--dry-run" for a in args)


def test_gpu_jax_present_without_dry_run_installs_nothing(tmp_path):
  out, calls = _run(tmp_path, "precision")
  assert out.returncode == 0, out.stderr
  assert not _pip_calls(calls)
  (report,) = _report_calls(calls)
  args = report.split()[2:]
  assert args[:2] == ["--out=lab/notes", "--stages=precision"]
  # the call's budget counts from the script's start, not the driver's
  (started,) = [a for a in args[2:] if a.startswith("--call_started=")]
  assert abs(int(started.split("=")[1]) - time.time()) < 60


def test_no_stage_passes_none_and_dry_run_is_not_a_stage(tmp_path):
  out, calls = _run(tmp_path, "--dry-run")
  assert out.returncode == 0, out.stderr
  (report,) = _report_calls(calls)
  assert "--dry_run" in report.split()
  assert "--stage" not in report  # the driver runs every stage


def test_without_gpu_jax_the_cuda_extras_are_installed(tmp_path):
  """The fake fails on that install: proof that the tests above would catch
  a script that installs on a GPU node."""
  out, calls = _run(tmp_path, "bench", probe="0.10.2 -")
  assert out.returncode == 97
  assert "installing .[cuda13,bench]" in out.stdout
  assert any(".[cuda13,bench]" in c for c in _pip_calls(calls))
  out, calls = _run(tmp_path / "b", "bench", probe="0.10.2 -",
                    env={"CUDA_EXTRA": "cuda12"})
  assert any(".[cuda12,bench]" in c for c in _pip_calls(calls))


@pytest.mark.parametrize("args,env", [(["--no-install"], {}),
                                      ([], {"NO_INSTALL": "1"})])
def test_no_install(tmp_path, args, env):
  out, calls = _run(tmp_path, *args, "bench", probe="- -", env=env)
  assert out.returncode == 0, out.stderr
  assert "--no-install: nothing installed" in out.stdout
  assert not _pip_calls(calls) and len(_report_calls(calls)) == 1


def test_missing_module_comes_from_wheels(tmp_path):
  out, calls = _run(tmp_path, "bench",
                    missing="ml_collections tensorboardX einops flashrnn",
                    wheels=("ml_collections-1.1.0-py3-none-any.whl",
                            "einops-0.8.2-py3-none-any.whl",
                            "flashrnn-1.0.8-py3-none-any.whl"))
  assert out.returncode == 0, out.stderr
  assert "ml_collections from wheels/" in out.stdout
  assert "tensorboardX missing" in out.stdout
  pips = [p.split()[2:] for p in _pip_calls(calls)]
  # a distribution's needs before it: einops before flashrnn
  assert pips == [["install", "-q", "--no-index", "--find-links", "wheels",
                   name] for name in ("ml-collections", "einops", "flashrnn")]


def test_a_callers_out_gets_the_calls_log(tmp_path):
  """OUT set by the caller (the folder a node sends back): the call's
  output is also in OUT/gpu-report.log; without OUT there is no log."""
  out_dir = tmp_path / "out"
  out, calls = _run(tmp_path, "--dry-run", "kernel",
                    env={"OUT": str(out_dir)})
  assert out.returncode == 0, out.stderr
  log = (out_dir / "gpu-report.log").read_text()
  assert "=== gpu_report --stages=kernel --dry_run" in log
  assert f"--out={out_dir}" in _report_calls(calls)[0]
  out, _ = _run(tmp_path / "b", "--dry-run", "kernel")
  assert not list((tmp_path / "b").rglob("gpu-report.log"))


def test_flashrnn_missing_without_wheel_is_not_fatal(tmp_path):
  """FlashRNN is optional: without its wheel the report still runs, and
  says its rows will give the reason."""
  out, calls = _run(tmp_path, "kernel", missing="flashrnn")
  assert out.returncode == 0, out.stderr
  assert "flashrnn missing: the FlashRNN rows will say why" in out.stdout
  assert len(_report_calls(calls)) == 1 and not _pip_calls(calls)


def test_missing_module_without_wheel_says_how(tmp_path):
  out, calls = _run(tmp_path, "bench", missing="ml_collections")
  assert out.returncode == 1
  assert "bash launch/gpu_wheels.sh" in out.stderr
  assert not _report_calls(calls) and not _pip_calls(calls)


def test_python3_is_preferred_and_must_import_jax(tmp_path):
  """python3 first; a python3 without jax loses to a python with it."""
  out, calls = _run(tmp_path, "--dry-run", "bench")
  assert out.returncode == 0, out.stderr
  assert f"python: {tmp_path / 'bin' / 'python3'}" in out.stdout
  assert len(_report_calls(calls)) == 1
  no_jax = ("#!/usr/bin/env bash\n"
            "echo \"$*\" >> \"$FAKE_LOG.python3\"\n"
            "[[ \"$2\" == \"import jax\" ]] && exit 1\n"
            "echo 'python3 without jax ran' >&2; exit 98\n")
  out, calls = _run(tmp_path / "b", "--dry-run", "bench", python3=no_jax)
  assert out.returncode == 0, out.stderr
  assert f"python: {tmp_path / 'b' / 'bin' / 'python'}" in out.stdout
  assert len(_report_calls(calls)) == 1  # the report ran on python
  tried = (tmp_path / "b" / "calls.log.python3").read_text().splitlines()
  assert tried == ["-c import jax"]


def test_unknown_option(tmp_path):
  out, calls = _run(tmp_path, "--fast")
  assert out.returncode == 2 and "unknown option --fast" in out.stderr
  assert not calls


def test_real_probe_finds_a_cuda_plugin(tmp_path):
  """The probe itself, in this Python: a jax_cuda13_plugin module on the
  path counts as a GPU jax; a stub pip and a stub report stand in."""
  root, _ = _fake_repo(tmp_path)
  (root / "jax_cuda13_plugin").mkdir()
  (root / "jax_cuda13_plugin" / "__init__.py").write_text("")
  (root / "pip").mkdir()
  (root / "pip" / "__init__.py").write_text("")
  (root / "pip" / "__main__.py").write_text("raise SystemExit(97)\n")
  lab = root / "lab"
  lab.mkdir()
  (lab / "__init__.py").write_text("")
  (lab / "gpu_report.py").write_text(textwrap.dedent("""\
      import sys
      print("REPORT", *sys.argv[1:])
      """))
  env = {k: v for k, v in os.environ.items()
         if k not in ("NO_INSTALL", "OUT", "CUDA_EXTRA")}
  env.update(PYTHON=sys.executable, PYTHONPATH=str(root))
  out = subprocess.run(["bash", str(root / "launch" / "gpu_report.sh"),
                        "bench"], capture_output=True, text=True, env=env,
                       timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "with CUDA plugin found (jax_cuda13_plugin): nothing installed" \
         in out.stdout
  assert "REPORT --out=lab/notes --stages=bench" in out.stdout


# ------------------------------------------------------------- rehearsal


def _rehearse(tmp_path, *args, **env):
  environ = {k: v for k, v in os.environ.items()
             if k not in ("NO_INSTALL", "OUT", "REHEARSAL_CALL_BUDGET")}
  environ.update(PYTHON=sys.executable, TMPDIR=str(tmp_path), **env)
  return subprocess.run(
      ["bash", os.path.join(REPO, "launch", "gpu_rehearsal.sh"), "--here",
       *args], capture_output=True, text=True, env=environ, timeout=400)


def _ledger(stdout: str) -> dict:
  """{what: seconds} of the ledger the rehearsal printed."""
  found = {}
  for line in stdout.splitlines():
    match = re.fullmatch(r"  (\S.*?)\s+(\d+) s", line)
    if match:
      found[match.group(1)] = int(match.group(2))
  return found


@pytest.mark.slow
def test_a_call_killed_mid_kernel_stage_returns_every_row_before(tmp_path):
  """The rehearsal's call (a copy of this tree, this Python, dry shapes),
  killed with its whole process group once the kernel stage has 6 rows
  on disk, mid-stage, as the node's timeout would: every row the call
  printed as measured is in the gpu-results.json it leaves, and the ledger
  printed is the budget file's."""
  out = _rehearse(tmp_path, "--stages", "kernel", "--kill-after", "kernel:6")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  measured = [l for l in out.stdout.splitlines()
              if l.startswith("| measured kernel rows/")]
  assert len(measured) >= 6
  assert "killed once kernel had 6 rows; " in out.stdout
  assert f"{len(measured)} rows measured, each one in the returned" \
      in out.stdout
  assert _ledger(out.stdout) == dict(gpu_budget.ledger())
  assert not [p for p in os.listdir(tmp_path)
              if p.startswith("zebra-gpu-rehearsal")]  # nothing left behind


# ------------------------------------------------------------ TensorBoard


@pytest.mark.slow
def test_training_without_tensorboardx(tmp_path):
  """tensorboardX cannot be imported: the run finishes, metrics.jsonl has its
  rows and stderr one warning line about TensorBoard."""
  blocker = tmp_path / "blocked" / "tensorboardX"
  blocker.mkdir(parents=True)
  (blocker / "__init__.py").write_text(
      "raise ImportError('tensorboardX blocked by the test')\n")
  text = tmp_path / "story.txt"
  text.write_text("".join(f"line {i}: the quick brown fox jumps over the "
                          "lazy dog.\n" for i in range(100)))
  workdir = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(tmp_path / "blocked"), REPO, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run(
      [sys.executable, "-m", "zebra_jax.main",
       "--config=demo:tiny", f"--workdir={workdir}",
       "--config.data.source=text", f"--config.data.path={text}",
       "--config.train.num_steps=4", "--config.train.log_every=2",
       "--config.train.eval_every=1000", "--config.checkpoint.every_steps=4",
       "--config.train.report_at_end=false",
       "--config.train.sample_at_eval=false"],
      capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
  assert out.returncode == 0, out.stderr
  rows = [json.loads(l) for l in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4]
  about_tb = [l for l in out.stderr.splitlines() if "tensorboard" in l.lower()]
  assert len(about_tb) == 1, out.stderr
  assert about_tb[0].startswith("warning: tensorboardX is not installed")
  assert "pip install tensorboardX" in about_tb[0]


def test_no_tensorboard_at_all_warns_once(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)
  monkeypatch.setitem(sys.modules, "tensorboard", None)
  monkeypatch.setattr(writer, "_warned", set())
  for name in ("a", "b"):  # two runs in one process: one warning
    log = writer.MetricWriter(str(tmp_path / name))
    log.eval_line(1, 10, "valid", {"loss": 1.0, "ppl": 2.72, "acc": 0.5})
    log.text("samples", "hello", 10)
    log.close()
    assert not (tmp_path / name / "tensorboard").exists()
    assert (tmp_path / name / "metrics.jsonl").read_text().count("\n") == 1
  lines = capsys.readouterr().err.splitlines()
  assert lines == ["warning: tensorboardX is not installed: TensorBoard "
                   "scalars are off (metrics.jsonl has every figure); pip "
                   "install tensorboardX to get them"]


def test_event_writer_without_tensorboardx_reads_back(tmp_path, monkeypatch):
  event_accumulator = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  monkeypatch.setitem(sys.modules, "tensorboardX", None)
  monkeypatch.setattr(writer, "_warned", set())
  log = writer.MetricWriter(str(tmp_path))
  assert isinstance(log._tb, writer.EventWriter)  # pylint: disable=protected-access
  log.eval_line(1, 200, "valid", {"loss": 1.55, "ppl": 4.71, "acc": 0.534})
  log.text("samples", "the quick fox", 200)
  log.close()
  acc = event_accumulator.EventAccumulator(
      str(tmp_path / "tensorboard"),
      size_guidance={event_accumulator.SCALARS: 0,
                     event_accumulator.TENSORS: 0})
  acc.Reload()
  assert set(acc.Tags()["scalars"]) == {"valid/loss", "valid/ppl", "valid/acc"}
  assert acc.Scalars("valid/ppl")[0].step == 200
  assert acc.Scalars("valid/ppl")[0].value == pytest.approx(4.71, rel=1e-6)
  (text,) = acc.Tensors("samples/text_summary")
  assert text.tensor_proto.string_val == [b"the quick fox"]
