"""Logs that stay true across a resume: one metrics.jsonl record and one
TensorBoard point per step after SIGKILLs, the config in TensorBoard's
hparams dashboard, and a profile window a resume has passed.

Event files are read back with tensorboard's EventAccumulator, which applies
the purge of a resumed writer as TensorBoard does.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from zebra_jax.runtime import plots, profiling, writer
from tests.helpers import REPO

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")
plugin_data_pb2 = pytest.importorskip(
    "tensorboard.plugins.hparams.plugin_data_pb2")

TIMEOUT = 300


def _accumulator(logdir):
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.SCALARS: 0,
                             event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def _scalar_steps(acc, tag):
  return [e.step for e in acc.Scalars(tag)]


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _hparams(logdir):
  """{name: value} of the session-start summaries, and the metric tags of
  the experiment summary, as the hparams plugin reads them."""
  content = _accumulator(logdir).PluginTagToContent("hparams")
  values, metrics = {}, []
  for tag, raw in content.items():
    data = plugin_data_pb2.HParamsPluginData.FromString(raw)
    if tag == "_hparams_/session_start_info":
      for name, value in data.session_start_info.hparams.items():
        values[name] = getattr(value, value.WhichOneof("kind"))
    elif tag == "_hparams_/experiment":
      metrics = [m.name.tag for m in data.experiment.metric_infos]
  return values, metrics


# ------------------------------------------------ a real run, killed twice


def _readable_records(workdir):
  """metrics.jsonl's records so far (a line being written is left out)."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return []
  return plots.read_metrics(workdir)


def _train_steps(workdir):
  return [r["step"] for r in _readable_records(workdir)
          if r["kind"] == "train"]


def _saved_steps(workdir):
  """The finished checkpoints: orbax renames a step's folder into place when
  the step is whole."""
  names = glob.glob(os.path.join(workdir, "checkpoints", "*"))
  return sorted(int(os.path.basename(n)) for n in names
                if os.path.basename(n).isdigit())


def _stopped(pid):
  """Whether every thread of a process is stopped (state T)."""
  states = []
  for path in glob.glob(f"/proc/{pid}/task/*/stat"):
    try:
      with open(path) as f:
        states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:
      continue  # a thread that ended meanwhile
  return bool(states) and set(states) == {"T"}


def _kill_past_a_checkpoint(args, workdir, after, log):
  """Starts the CLI and SIGKILLs it once a checkpoint past step `after` is
  on disk and metrics.jsonl has train records past that checkpoint;
  (its stdout, the last train step it logged, the last checkpoint)."""
  def ready():
    steps, saved = _train_steps(workdir), _saved_steps(workdir)
    return (saved and saved[-1] > after and steps
            and steps[-1] > saved[-1] and steps[-1] % 8)
  with open(log, "w") as out:
    proc = subprocess.Popen(args, cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT)
    try:
      deadline = time.time() + TIMEOUT
      while True:
        if ready():
          proc.send_signal(signal.SIGSTOP)  # holds it at a step to check
          while not _stopped(proc.pid):
            assert time.time() < deadline, "SIGSTOP did not stop it"
            time.sleep(0.01)
          if ready():
            break
          proc.send_signal(signal.SIGCONT)  # reached a checkpoint meanwhile
        assert proc.poll() is None, open(log).read()[-3000:]
        assert time.time() < deadline, f"not ready in {TIMEOUT} s"
        time.sleep(0.02)  # polling the files, not waiting for a guess
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=TIMEOUT)
    finally:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL
  return open(log).read(), _train_steps(workdir)[-1], _saved_steps(workdir)[-1]


def _resumed_step(stdout):
  """The step a run said it resumed from (0: it started fresh)."""
  for line in stdout.splitlines():
    if line.startswith("resuming from checkpoint at step "):
      return int(line.split()[5])
  return 0


@pytest.mark.slow
def test_sigkill_twice_leaves_one_record_and_point_per_step(tmp_path):
  workdir = str(tmp_path / "run")
  args = [sys.executable, "-m", "zebra_jax.main", "--config=demo:tiny",
          f"--workdir={workdir}", "--config.train.log_every=1",
          "--config.train.eval_every=8", "--config.checkpoint.every_steps=8",
          "--config.train.report_at_end=false",
          "--config.train.sample_at_eval=false"]
  endless = args + ["--config.train.num_steps=1000000"]
  _, killed_at, saved = _kill_past_a_checkpoint(endless, workdir, 0,
                                                tmp_path / "first.log")
  past = [r for r in _readable_records(workdir) if r["step"] > saved]
  second, killed_again, saved_again = _kill_past_a_checkpoint(
      endless, workdir, killed_at, tmp_path / "second.log")
  resumed = _resumed_step(second)
  assert resumed == saved < killed_at, second[-3000:]
  assert f"dropped {len(past)} record(s) past step {saved}" in second
  # The last run ends at an eval step; it also profiles step 2, which both
  # earlier runs passed.
  num_steps = (killed_again // 8 + 2) * 8
  done = subprocess.run(args + [f"--config.train.num_steps={num_steps}",
                                "--config.profile.start_step=2",
                                "--config.profile.num_steps=1"],
                        cwd=REPO, capture_output=True, text=True,
                        timeout=TIMEOUT)
  assert done.returncode == 0, done.stderr[-3000:]
  last = _resumed_step(done.stdout)
  assert last == saved_again < killed_again, done.stdout[-3000:]
  assert (f"profile: steps 2-2 came before the resume at step {last}; "
          f"tracing steps {last + 2}-{last + 2} instead") in done.stdout
  assert glob.glob(os.path.join(workdir, "profile", "**", "*.xplane.pb"),
                   recursive=True)

  records = _records(workdir)
  steps = lambda kind: [r["step"] for r in records if r["kind"] == kind]
  # Each run's first step compiles: it is kept out of the train records.
  everything = [s for s in range(1, num_steps + 1)
                if s - 1 not in (0, saved, saved_again)]
  evals = list(range(8, num_steps + 1, 8))
  assert steps("train") == everything
  assert steps("valid") == evals
  assert steps("start") == [0, resumed, last]
  assert steps("summary") == [num_steps]
  assert [r["step"] for r in records] == sorted(r["step"] for r in records)

  acc = _accumulator(os.path.join(workdir, "tensorboard"))
  for tag in ("train/loss", "train/lr", "train/grad_norm"):
    assert _scalar_steps(acc, tag) == everything, tag
  for tag in ("valid/loss", "valid/ppl"):
    assert _scalar_steps(acc, tag) == evals, tag
  losses = [r["loss"] for r in records if r["kind"] == "train"]
  assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(
      losses, rel=1e-6)
  hparams, metrics = _hparams(os.path.join(workdir, "tensorboard"))
  assert hparams["model.hidden_size"] == 32
  # TensorBoard keeps a tag's first metadata: the config the run started with.
  assert hparams["train.num_steps"] == 1000000
  assert "valid/ppl" in metrics and "summary/best_valid_ppl" in metrics


# ------------------------------------------- both writers, one rule each


@pytest.fixture(params=["tensorboardX", "tensorboard"])
def event_writer(request, monkeypatch):
  """Each TensorBoard writer: tensorboardX's, and the fallback through the
  tensorboard package alone."""
  monkeypatch.setattr(writer, "_warned", set())
  if request.param == "tensorboard":
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
  return request.param


def _train(log, steps):
  for step in steps:
    log.train_line(epoch=1, step=step, batch=step, batches=100, lr=1e-3,
                   ms_per_batch=1.0, tok_per_s=1.0, loss=float(step),
                   ppl=1.0, acc=None, grad_norm=1.0)
    if step % 4 == 0:
      log.eval_line(step // 4, step, "valid", {"loss": step + 0.5, "ppl": 2.0})


def test_resume_purges_events_and_records_past_the_start(tmp_path, capsys,
                                                         event_writer):
  workdir = str(tmp_path)
  log = writer.MetricWriter(workdir, start_step=0)
  _train(log, range(1, 11))  # checkpoint at 4, killed after step 10
  log.close()
  log = writer.MetricWriter(workdir, start_step=4)
  assert isinstance(log._tb, writer.EventWriter) == (  # pylint: disable=protected-access
      event_writer == "tensorboard")
  _train(log, range(5, 13))
  log.close()
  assert ("metrics.jsonl: dropped 7 record(s) past step 4; the run goes on "
          "from step 4") in capsys.readouterr().out

  acc = _accumulator(os.path.join(workdir, "tensorboard"))
  assert _scalar_steps(acc, "train/loss") == list(range(1, 13))
  assert [e.value for e in acc.Scalars("train/loss")] == list(range(1, 13))
  assert _scalar_steps(acc, "valid/loss") == [4, 8, 12]
  assert [r["step"] for r in _records(workdir)] == [
      1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 12]


def test_hparams_in_the_run_directory(tmp_path, event_writer):
  log = writer.MetricWriter(str(tmp_path), start_step=0)
  config = {"model": {"hidden_size": 32, "head": "full",
                      "adaptive_cutoffs": (100, 200), "tie": True},
            "optim": {"learning_rate": 3e-3, "clip_norm": None}}
  log.hparams(config, ("valid/ppl", "train/loss"), 0)
  _train(log, range(1, 5))
  log.close()
  logdir = os.path.join(str(tmp_path), "tensorboard")
  assert [d for d in os.listdir(logdir)
          if os.path.isdir(os.path.join(logdir, d))] == []  # no subdirectory
  hparams, metrics = _hparams(logdir)
  assert hparams == {"model.hidden_size": 32, "model.head": "full",
                     "model.adaptive_cutoffs": "[100, 200]",
                     "model.tie": True, "optim.learning_rate": 3e-3,
                     "optim.clip_norm": "None"}
  assert metrics == ["valid/ppl", "train/loss"]


# ------------------------------------------------------ metrics.jsonl rule


def test_drop_records_after_keeps_every_kind_up_to_the_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  kept = [{"kind": "start", "step": 0}, {"kind": "train", "step": 5},
          {"kind": "valid", "step": 10}, {"kind": "summary", "step": 10},
          {"kind": "final_test", "step": 10}, {"kind": "start", "step": 10}]
  past = [{"kind": "train", "step": 11}, {"kind": "valid", "step": 20},
          {"kind": "final_valid", "step": 20}]
  text = "".join(json.dumps(r) + "\n" for r in kept + past)
  path.write_text(text + '{"kind": "train", "st')  # killed mid-write
  assert writer.drop_records_after(str(path), 10) == (3, 1)
  assert [json.loads(l) for l in path.read_text().splitlines()] == kept
  before = os.stat(path).st_mtime_ns
  assert writer.drop_records_after(str(path), 10) == (0, 0)
  assert os.stat(path).st_mtime_ns == before  # nothing to drop: untouched
  assert writer.drop_records_after(str(tmp_path / "none.jsonl"), 3) == (0, 0)


def test_a_record_without_its_newline_is_kept_whole(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}')
  assert writer.drop_records_after(str(path), 5) == (0, 0)
  assert path.read_text().endswith('"step": 2}\n')  # the next one appends


def test_evaluation_appends_without_dropping(tmp_path):
  log = writer.MetricWriter(str(tmp_path), tensorboard=False, start_step=0)
  _train(log, [1, 2, 3])
  log.close()
  log = writer.MetricWriter(str(tmp_path), tensorboard=False)
  log.record("final_valid", 2, {"loss": 1.0})
  log.close()
  assert [r["step"] for r in _records(str(tmp_path))] == [1, 2, 3, 2]


# ------------------------------------------------------------ profile window


def _profiled_steps(tmp_path, start, num, first):
  lines = []
  profiler = profiling.StepProfiler(str(tmp_path), start, num, first,
                                    lines.append)
  traced = []
  for step in range(first, first + 8):
    profiler.before_step(step)
    if profiler.active:
      traced.append(step)
    out = jnp.ones(4) * step
    profiler.after_step(step, out)
  profiler.close()
  return traced, lines


def test_profile_window_passed_by_a_resume_counts_from_it(tmp_path):
  traced, lines = _profiled_steps(tmp_path, 2, 2, 10)
  assert traced == [12, 13]
  assert lines == ["profile: steps 2-3 came before the resume at step 10; "
                   "tracing steps 12-13 instead"]
  assert glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"),
                   recursive=True)


@pytest.mark.parametrize("first", [0, 2])
def test_profile_window_ahead_of_the_start_stays(tmp_path, first):
  traced, lines = _profiled_steps(tmp_path, 2, 2, first)
  assert traced == [2, 3] and lines == []
