"""gpu_report's driver: a stage killed midway keeps the rows it finished,
and a stage past its budget is stopped (the stages themselves:
tests/lab/benchmarks/test_gpu_stages.py)."""

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lab import gpu_report


def _stage_child_pid(stage, out):
  """The pid of the child process running `stage` into `out`, or None."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    except OSError:
      continue
    if f"--stage_child={stage}" in args and f"--out={out}" in args:
      return int(pid)
  return None


@pytest.mark.slow
def test_a_stage_killed_midway_keeps_its_rows(tmp_path):
  # The real command line: the driver starts the smoke stage's process; it
  # is killed once its first row (the backend jax lowers to) is on disk.
  out = str(tmp_path)
  path = tmp_path / "gpu-results.json"
  driver = subprocess.Popen(
      [sys.executable, "-m", "lab.gpu_report", "--stages=smoke",
       "--dry_run", f"--out={out}", "--carry_from="],
      stdout=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    try:
      rows = json.loads(path.read_text())["stages"]["smoke"]["rows"]
    except (OSError, ValueError, KeyError):
      rows = 0
    if rows >= 1:
      break
    time.sleep(0.2)
  os.kill(_stage_child_pid("smoke", out), signal.SIGKILL)
  stdout, _ = driver.communicate(timeout=60)
  assert driver.returncode == 1  # a stage did not finish; its rows stay

  report = json.loads(path.read_text())
  status = report["stages"]["smoke"]
  assert status["status"] == (
      f"stopped by SIGKILL after {status['rows']} rows")
  assert report["smoke"]["lowered_for_cuda"]["backend"] == "triton"
  assert status["rows"] == 1 + len(report["smoke"].get("rows", []))
  page = (tmp_path / "gpu-results.md").read_text()
  assert "- Pallas GPU backend: triton" in page
  assert "- stages: smoke stopped by SIGKILL" in page
  assert "- stages: smoke stopped by SIGKILL" in stdout  # the printed summary

  # A stage past its budget: its process group is killed, the report says so.
  # 0.3 s is less than any stage's child takes to import jax.
  gpu_report.drive(["scaling"], out, dry=True, budgets={"scaling": 0.3})
  report = json.loads(path.read_text())
  assert report["stages"]["scaling"]["status"].startswith(
      "stopped at its budget after")
  assert report["smoke"]["lowered_for_cuda"]  # the earlier stage's rows stay


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def test_a_stage_leaves_no_process_behind(tmp_path, monkeypatch):
  """A stage process that ends leaving one of its own running (a compiler
  a build started): the driver kills it, so nothing holds the call's
  output open. The stage here is a shell script in the child's place."""
  left = tmp_path / "left.pid"
  stage = tmp_path / "stage.sh"
  stage.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {left}\n")
  stage.chmod(0o755)
  monkeypatch.setattr(gpu_report.sys, "executable", str(stage))
  start = time.monotonic()
  report = gpu_report.drive(["scaling"], str(tmp_path / "out"), dry=True,
                            budgets={"scaling": 60})
  assert time.monotonic() - start < 30
  assert report["stages"]["scaling"]["status"] != "running"
  pid = int(left.read_text())
  deadline = time.monotonic() + 10
  while _running(pid) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not _running(pid)


def test_stages_past_the_calls_deadline_do_not_start(tmp_path):
  """The call's budget is spent: the stages left are marked, none starts
  (no child process: this returns in well under a stage's start)."""
  start = time.monotonic()
  report = gpu_report.drive(["infer", "scaling"], str(tmp_path), dry=True,
                            deadline=time.time() - 1)
  assert time.monotonic() - start < 20
  assert {s: report["stages"][s]["status"] for s in ("infer", "scaling")} == {
      s: "not run: the call's budget is spent" for s in ("infer", "scaling")}


def test_stages_run_in_the_budget_files_order():
  assert gpu_report.parse_stages(["all"]) == gpu_report.STAGES
  assert gpu_report.parse_stages(["profile", "smoke"]) == ("smoke", "profile")
  with pytest.raises(gpu_report.UserError, match=r"unknown stages \['bench'\]"):
    gpu_report.parse_stages(["bench", "smoke"])


def test_profile_stage_gets_the_xla_dump_flags(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
  env = gpu_report.stage_env("profile", str(tmp_path))
  assert env["XLA_FLAGS"] == (
      f"--xla_gpu_autotune_level=2 --xla_dump_to={tmp_path}/xla_dump "
      "--xla_dump_hlo_as_text --xla_gpu_enable_command_buffer=")
  assert env["XLA_FLAGS"] not in gpu_report.stage_env("wt103",
                                                      str(tmp_path)).values()
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


@pytest.mark.parametrize("args,code,stream,start", [
    (["--help"], 0, "stdout", "Every GPU figure in one command"),
    (["--stages=bench"], 2, "stderr", "error: unknown stages ['bench']"),
    (["--bogus"], 2, "stderr", "error: Unknown command line flag 'bogus'")])
def test_command_line(args, code, stream, start):
  done = subprocess.run([sys.executable, "-m", "lab.gpu_report", *args],
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == code, done.stderr
  assert getattr(done, stream).startswith(start)
  if code == 2:
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("version", [
    "0.10.1", "0.10.2", "0.11.2", "0.13.9", "0.14", "0.14.0", "2.11.0+cu130",
    "2.5.2", "1.26", "3.0.0"])
@pytest.mark.parametrize("spec", [">=0.10.2,<0.14", ">=1.26,<3", ">=2.4",
                                  "==0.14", "!=2.5.2", "<=0.11.2,>0.10.1"])
def test_satisfies_agrees_with_packaging(version, spec):
  specifiers = pytest.importorskip("packaging.specifiers")
  want = specifiers.SpecifierSet(spec).contains(version, prereleases=True)
  assert gpu_report.satisfies(version, spec) == want


def test_check_versions_names_what_is_outside(tmp_path):
  (tmp_path / "pyproject.toml").write_text(
      '[project]\n'
      'dependencies = ["numpy>=1.0,<99", "absl-py>=99", '
      '"no-such-package-zebra>=1"]\n'
      '[project.optional-dependencies]\n'
      'bench = ["pytest>=1"]\n')
  report = gpu_report.check_versions(str(tmp_path / "pyproject.toml"))
  absl = importlib.metadata.version("absl-py")
  assert report["outside"] == [f"absl-py {absl} (pyproject.toml: >=99)"]
  assert report["missing"] == ["no-such-package-zebra"]
  assert report["installed"]["numpy"] == importlib.metadata.version("numpy")
  assert report["required"]["pytest"] == ">=1"


def test_the_previous_call_carries_into_an_empty_out(tmp_path, capsys):
  """The node's OUT starts empty: the tree's file is copied in; an OUT
  that has a file keeps it; a file is never copied over itself."""
  previous = tmp_path / "docs" / "gpu-results.json"
  previous.parent.mkdir()
  previous.write_text(json.dumps({"dry_run": True,
                                  "stages": {"smoke": {"status": "done"}}}))
  out = tmp_path / "out"
  gpu_report._carry(str(out), str(previous))  # pylint: disable=protected-access
  assert json.loads((out / "gpu-results.json").read_text()) == json.loads(
      previous.read_text())
  assert "stages smoke" in capsys.readouterr().out
  (out / "gpu-results.json").write_text("{}")
  gpu_report._carry(str(out), str(previous))  # pylint: disable=protected-access
  assert (out / "gpu-results.json").read_text() == "{}"
  gpu_report._carry(str(previous.parent), str(previous))  # pylint: disable=protected-access
  assert "no previous results carried" in capsys.readouterr().out


def test_a_reruns_stages_merge_into_the_first_calls_file(tmp_path):
  """The rerun's stages replace theirs; every other stage's rows stay;
  the page is rewritten from the merged file."""
  first = gpu_report.Results(str(tmp_path / "docs"))
  first.data["dry_run"] = False
  first.update("scaling", {"stripes": 8, "per_device_batch": 64,
                           "seq_len": 64, "hidden": 1024}, rows=0)
  first.append("scaling", "rows", [{"devices": 1, "global_batch": 64,
                                    "tokens_per_s": 10.0, "ms_per_step": 1.0,
                                    "efficiency": 1.0}])
  first.data["stages"]["scaling"]["status"] = "done"
  first.update("wt103", {"compile_s": 90.0, "params": 113_000_000})
  first.data["stages"]["wt103"]["status"] = (
      "stopped at its budget after 1 rows")
  first.save()
  rerun = gpu_report.Results(str(tmp_path / "rerun"))
  rerun.data["dry_run"] = False
  rerun.update("wt103", {"compile_s": 50.0, "params": 113_000_000})
  rerun.data["stages"]["wt103"]["status"] = "done"
  rerun.save()

  merged = gpu_report.merge(str(tmp_path / "docs"),
                            str(tmp_path / "rerun" / "gpu-results.json"))
  assert merged["wt103"] == {"compile_s": 50.0, "params": 113_000_000}
  assert merged["stages"]["wt103"]["status"] == "done"
  assert merged["scaling"]["rows"][0]["tokens_per_s"] == 10.0
  saved = json.loads((tmp_path / "docs" / "gpu-results.json").read_text())
  assert saved == merged
  page = (tmp_path / "docs" / "gpu-results.md").read_text()
  assert "compiled in 50 s" in page and "| 1 | 10 | 1.0 | 100% |" in page

  # A rerun's file also holds what it carried from the last call (an
  # older scaling row here): only the stages it ran are merged.
  rerun.data["ran"] = ["wt103"]
  rerun.update("scaling", {**merged["scaling"], "rows": [
      {**merged["scaling"]["rows"][0], "tokens_per_s": 99.0}]}, rows=0)
  rerun.save()
  merged = gpu_report.merge(str(tmp_path / "docs"),
                            str(tmp_path / "rerun" / "gpu-results.json"))
  assert merged["scaling"]["rows"][0]["tokens_per_s"] == 10.0
  assert merged["stages"]["scaling"]["status"] == "done"

  rerun.data["dry_run"] = True
  rerun.save()
  with pytest.raises(gpu_report.UserError, match="dry run"):
    gpu_report.merge(str(tmp_path / "docs"),
                     str(tmp_path / "rerun" / "gpu-results.json"))
