"""The GPU report's one budget file: the call fits the node's window with
room for a rerun, a stage raised past the call's budget is caught; and the
rehearsal's call runner, which kills a call as the node's timeout does and
checks that every row measured before the kill came back."""

import json
import os
import sys
import textwrap

import pytest

from lab.benchmarks import gpu_budget, gpu_rehearsal, gpu_results


def test_the_budgets_fit_the_window():
  assert gpu_budget.problems() == []
  assert gpu_budget.call_seconds(gpu_budget.STAGE_BUDGET_S) <= 480
  assert gpu_budget.CALL_BUDGET_S <= 480
  ledger = dict(gpu_budget.ledger())
  spent = ledger["start"] + ledger["call"] + ledger["copy-back"]
  assert spent < gpu_budget.DEVICE_WINDOW_S == 900
  assert spent + ledger["rerun margin"] + ledger["release"] == 900
  assert ledger["rerun margin"] >= gpu_budget.RERUN_MIN_S
  assert gpu_budget.STAGES[:2] == ("smoke", "kernel")  # value first
  assert set(gpu_budget.DRY_BUDGET_S) == set(gpu_budget.STAGES)


@pytest.mark.parametrize("stage", gpu_budget.STAGES)
def test_a_stage_raised_past_the_call_is_caught(stage):
  spare = gpu_budget.CALL_BUDGET_S - gpu_budget.call_seconds(
      gpu_budget.STAGE_BUDGET_S)
  raised = {**gpu_budget.STAGE_BUDGET_S}
  raised[stage] += spare
  assert gpu_budget.problems(raised) == []  # up to the call's budget: fits
  raised[stage] += 1
  (problem,) = gpu_budget.problems(raised)
  assert problem.endswith(f"= {gpu_budget.CALL_BUDGET_S + 1} s > the "
                          f"call's {gpu_budget.CALL_BUDGET_S} s")


def test_the_ledger_lines_are_the_ledger():
  lines = gpu_budget.ledger_lines()
  for what, seconds in gpu_budget.ledger():
    assert f"  {what:<13} {seconds:>4} s" in lines


# A call that measures a row every 0.1 s, as a stage does, until killed.
_FAKE_CALL = textwrap.dedent("""\
    import sys, time
    from lab.benchmarks.gpu_results import Results
    results = Results(sys.argv[1])
    results.data["stages"] = {"kernel": {"status": "running", "rows": 0}}
    results.update("kernel", {"shape": {"hidden": 8}})
    for i in range(1000):
      results.append("kernel", "rows", [{"name": f"row{i}", "dtype": "x"}])
      time.sleep(0.1)
    """)


def _fake_call(out):
  return [sys.executable, "-c", _FAKE_CALL, str(out)]


def test_a_killed_call_keeps_every_row_it_measured(tmp_path, capsys):
  # The kill waits for the 4th row on disk, however slowly a loaded machine
  # writes it: the budget is only a bound on a broken fake.
  call = gpu_rehearsal.run_call(_fake_call(tmp_path), str(tmp_path), 600,
                                kill_after=("kernel", 4))
  assert call["killed"] == "killed once kernel had 4 rows"
  assert call["returncode"] == -9
  measured = gpu_rehearsal.measured(call["log"])
  assert measured[:2] == [("kernel", "shape"), ("kernel", "rows/0/row0")]
  # A row is written to the file, then named in the log: the kill may fall
  # between the two for the 4th, never for the 3rd, printed before the 4th
  # was written (the pipe keeps what a killed process printed).
  assert len(measured) >= 3
  assert gpu_rehearsal.check(str(tmp_path), call["log"], ["kernel"],
                             call["killed"]) == []
  assert "| measured kernel rows/0/row0" in capsys.readouterr().out

  # The control: a row the log names but the file lost is reported.
  path = tmp_path / "gpu-results.json"
  report = json.loads(path.read_text())
  report["kernel"]["rows"].pop()
  path.write_text(json.dumps(report))
  (problem,) = gpu_rehearsal.check(str(tmp_path), call["log"], ["kernel"],
                                   call["killed"])
  assert problem.startswith("measured but not returned: kernel rows/")


def test_a_call_past_its_budget_is_killed(tmp_path):
  call = gpu_rehearsal.run_call(_fake_call(tmp_path), str(tmp_path), 1.0)
  assert call["killed"] == "killed at its 1 s budget"
  assert 1.0 <= call["seconds"] < 10
  # A call that ran to its end must have finished its stages.
  assert gpu_rehearsal.check(str(tmp_path), call["log"], ["kernel"], None) \
      == ["kernel: running"]


def test_row_ids_name_what_results_print(tmp_path, capsys):
  results = gpu_results.Results(str(tmp_path))
  results.update("profile", {"trace_archive": "t.tar.gz", "trace_bytes": 1,
                             "tensorboard": "tensorboard --logdir t"})
  results.append("kernel", "rows", [
      {"name": f"flashrnn_triton_S{s}", "impl": "flashrnn_triton",
       "stripes": s, "dtype": "bfloat16", "error": "no CUDA"} for s in (1, 8)])
  results.update("smoke", {"backend": "triton"}, rows=0)  # not a row
  printed = [l.split(" ", 3)[2:] for l in capsys.readouterr().out.splitlines()]
  assert {tuple(p) for p in printed} <= set(gpu_results.row_ids(results.data))
  assert printed == [["profile", "trace_archive"], ["profile", "trace_bytes"],
                     ["profile", "tensorboard"],
                     ["kernel", "rows/0/flashrnn_triton_S1"],
                     ["kernel", "rows/1/flashrnn_triton_S8"]]


def test_the_rehearsal_refuses_a_bad_kill_after(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    gpu_rehearsal.main([f"--out={tmp_path}", "--kill_after=kernel", "--",
                        "true"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.startswith("error: --kill_after wants")
  assert not os.listdir(tmp_path)


def test_a_folder_the_node_would_not_send_back_is_reported(tmp_path):
  for i in range(gpu_budget.RETURNED_FILES):
    (tmp_path / f"f{i}").write_bytes(b"x")
  assert gpu_rehearsal.too_much(str(tmp_path)) == []
  (tmp_path / "big").write_bytes(b"x" * (gpu_budget.RETURNED_FILE_BYTES + 1))
  assert gpu_rehearsal.too_much(str(tmp_path)) == [
      f"{gpu_budget.RETURNED_FILES + 1} files > {gpu_budget.RETURNED_FILES}",
      f"big: {gpu_budget.RETURNED_FILE_BYTES + 1} bytes > "
      f"{gpu_budget.RETURNED_FILE_BYTES}"]
