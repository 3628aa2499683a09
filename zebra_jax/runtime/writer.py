"""Run output: log lines on stdout, metrics.jsonl and TensorBoard scalars.

Only process 0 writes; the others stay quiet, so a multi-host run prints and
records each step once.

A run that starts at step S (a resume, or 0) keeps the logs true across the
restart: metrics.jsonl drops its records past S (rewritten atomically) and the
TensorBoard writer opens with purge_step S + 1, so TensorBoard discards the
events of the steps the run will train again. Each step then has one record.

TensorBoard is optional: event files come from tensorboardX when it is
installed, else from the `tensorboard` package's own event writer (scalars,
text and hparams, nothing else is written), else not at all. Each fallback says so in one
warning line on stderr; metrics.jsonl is written either way.
"""

import itertools
import json
import os
import sys
import time
from typing import Any

import jax

from zebra_jax.errors import UserError
from zebra_jax import progress, strict_json


TENSORBOARDX_HINT = "pip install tensorboardX"


class EventWriter:
  """TensorBoard event files through the `tensorboard` package alone: the
  add_scalar/add_text/close subset of tensorboardX's SummaryWriter, its
  purge_step, and hparams."""

  def __init__(self, logdir: str, purge_step: int | None = None):
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
    from tensorboard.summary.writer import event_file_writer
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    self._tensor_pb2, self._shape_pb2 = tensor_pb2, tensor_shape_pb2
    self._writer = event_file_writer.EventFileWriter(logdir)
    if purge_step is not None:  # as tensorboardX: readers drop steps >= it
      self._writer.add_event(event_pb2.Event(
          wall_time=time.time(), step=int(purge_step),
          session_log=event_pb2.SessionLog(
              status=event_pb2.SessionLog.START)))

  def _add(self, step: int, value) -> None:
    self.add_summary(self._summary_pb2.Summary(value=[value]), step)

  def add_summary(self, summary, step: int) -> None:
    self._writer.add_event(self._event_pb2.Event(
        wall_time=time.time(), step=int(step), summary=summary))

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    self._add(step, self._summary_pb2.Summary.Value(
        tag=tag, simple_value=float(value)))

  def add_text(self, tag: str, text: str, step: int) -> None:
    s = self._summary_pb2
    meta = s.SummaryMetadata(
        plugin_data=s.SummaryMetadata.PluginData(plugin_name="text"))
    tensor = self._tensor_pb2.TensorProto(
        dtype="DT_STRING", string_val=[text.encode("utf-8")],
        tensor_shape=self._shape_pb2.TensorShapeProto(
            dim=[self._shape_pb2.TensorShapeProto.Dim(size=1)]))
    self._add(step, s.Summary.Value(tag=f"{tag}/text_summary",
                                    metadata=meta, tensor=tensor))

  def hparams_summaries(self, hparams: dict, metric_tags) -> list:
    """The hparams dashboard's experiment and session-start summaries."""
    from tensorboard.plugins.hparams import summary_v2  # pylint: disable=g-import-not-at-top
    infos = [summary_v2.HParam(k, summary_v2.Discrete([v]))
             for k, v in hparams.items()]
    return [summary_v2.hparams_config_pb(
                infos, [summary_v2.Metric(t) for t in metric_tags]),
            summary_v2.hparams_pb(hparams)]

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


_warned = set()  # each fallback warns once per process, not once per run
_opened = itertools.count()  # writers opened in this process


def summary_writer(logdir: str, purge_step: int | None = None):
  """tensorboardX's SummaryWriter, else EventWriter, else None; a fallback
  prints one warning line on stderr (once per process). purge_step: readers
  discard the directory's earlier events at this step and later."""
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    # Its file names end in the second and the host: a second writer in the
    # same second would overwrite the first's file without the suffix.
    return SummaryWriter(logdir, purge_step=purge_step,
                         filename_suffix=f".{os.getpid()}.{next(_opened):04d}")
  except ImportError:
    pass
  try:
    writer = EventWriter(logdir, purge_step)
  except ImportError:
    _warn_once("tensorboardX is not installed: TensorBoard scalars are off "
               f"(metrics.jsonl has every figure); {TENSORBOARDX_HINT} to "
               "get them")
    return None
  _warn_once("tensorboardX is not installed: TensorBoard scalars written "
             f"with the tensorboard package instead ({TENSORBOARDX_HINT} "
             "for the usual writer)")
  return writer


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    warning(message)


def _write_hparams(tb, hparams: dict, metric_tags, step: int) -> None:
  """The hparams dashboard's experiment and session-start summaries, built
  with `tb`'s own protos (tensorboardX carries copies of TensorBoard's)."""
  if isinstance(tb, EventWriter):
    summaries, out = tb.hparams_summaries(hparams, metric_tags), tb
  else:
    from tensorboardX.summary import hparams as tbx_hparams  # pylint: disable=g-import-not-at-top
    experiment, start, _ = tbx_hparams(hparams, dict.fromkeys(metric_tags))
    summaries, out = [experiment, start], tb.file_writer
  for summary in summaries:
    out.add_summary(summary, step)


def flat_hparams(config: dict, prefix: str = "") -> dict:
  """{"model": {"hidden_size": 8}} -> {"model.hidden_size": 8}: the hparams
  dashboard takes numbers, strings and booleans only, so lists and None are
  written as their text."""
  flat = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(flat_hparams(value, f"{name}."))
    elif isinstance(value, (bool, int, float, str)):
      flat[name] = value
    else:
      flat[name] = str(list(value) if isinstance(value, tuple) else value)
  return flat


def drop_records_after(path: str, step: int) -> tuple[int, int]:
  """Rewrites metrics.jsonl without the records past `step` and the partial
  lines a killed write leaves; (records dropped, partial lines dropped).

  The steps past a resumed run's checkpoint are trained again, so their old
  records (any kind: train, eval, summary) would stand twice. The new file
  replaces the old one whole (a kill leaves one or the other), and an
  unchanged file is left untouched.
  """
  if not os.path.exists(path):
    return 0, 0
  with open(path, encoding="utf-8") as f:
    text = f.read()
  kept, past, torn = [], 0, 0
  for line in filter(None, text.split("\n")):
    try:
      late = json.loads(line)["step"] > step
    except (json.JSONDecodeError, KeyError, TypeError):
      torn += 1  # a partial line: no step to keep it by
      continue
    past += late
    if not late:
      kept.append(line + "\n")
  if "".join(kept) != text:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
      with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):  # a failed write: the old file stays as it was
        os.remove(tmp)
  return past, torn


class MetricWriter:
  """Transformer-XL style log lines plus one JSON record per line.

  start_step: the step training starts from (restored, or 0); the records
  and TensorBoard events past it are dropped. None (evaluation) appends.
  """

  def __init__(self, workdir: str, tensorboard: bool = True,
               start_step: int | None = None):
    self.active = jax.process_index() == 0
    self._jsonl = self._tb = None
    if self.active:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      if start_step is not None:
        self._drop_records_after(path, start_step)
      self._jsonl = open(path, "a")
      if tensorboard:
        self._tb = summary_writer(
            os.path.join(workdir, "tensorboard"),
            None if start_step is None else start_step + 1)

  def _drop_records_after(self, path: str, step: int) -> None:
    try:
      past, torn = drop_records_after(path, step)
    except OSError as e:
      raise UserError(f"could not rewrite {path} ({e.strerror or e}): free "
                      f"disk space or point --workdir elsewhere, then rerun "
                      f"to resume") from e
    if past or torn:
      torn_note = f" and {torn} partial line(s)" if torn else ""
      self.info(f"metrics.jsonl: dropped {past} record(s) past step {step}"
                f"{torn_note}; the run goes on from step {step}")

  def info(self, message: str) -> None:
    if self.active:
      info(message)

  def record(self, kind: str, step: int, values: dict[str, Any]) -> None:
    """One metrics.jsonl line (and TensorBoard scalars for numeric values);
    a non-finite value is written as null and left out of TensorBoard."""
    if not self.active:
      return
    values = strict_json.finite(values)  # NaN, inf: null here, none in TB
    try:
      self._jsonl.write(strict_json.dumps({"kind": kind, "step": step,
                                           "time": time.time(), **values})
                        + "\n")
      self._jsonl.flush()
      if self._tb is not None:
        for key, value in values.items():
          if isinstance(value, (int, float)):
            self._tb.add_scalar(f"{kind}/{key}", value, step)
        # On disk with its metrics.jsonl line: a killed run loses neither.
        self._tb.flush()
    except OSError as e:
      raise UserError(f"could not write metrics to {self._jsonl.name} "
                      f"({e.strerror or e}): free disk space or point --workdir "
                      f"elsewhere, then rerun to resume") from e

  def train_line(self, *, epoch, step, batch, batches, lr, ms_per_batch,
                 tok_per_s, loss, ppl, acc, grad_norm, loss_scale=None,
                 skipped=0) -> None:
    extra = f" | loss scale {loss_scale:.0f}" if loss_scale is not None else ""
    extra += f" | skipped {skipped}" if skipped or loss_scale is not None else ""
    # acc=None (not computed in training with the adaptive head) leaves it
    # out of the line, metrics.jsonl and TensorBoard.
    shown = f" | acc {acc:.3f}" if acc is not None else ""
    self.info(f"| epoch {epoch} step {step} | batches {batch}/{batches} "
              f"| lr {lr:.2e} | ms/batch {ms_per_batch:.1f} "
              f"| tok/s {tok_per_s:.0f} | loss {loss:.2f} | ppl {ppl:.2f}"
              f"{shown}{extra}")
    record = dict(epoch=epoch, lr=lr, ms_per_batch=ms_per_batch,
                  tok_per_s=tok_per_s, loss=loss, ppl=ppl,
                  grad_norm=grad_norm, skipped=skipped)
    if acc is not None:
      record["acc"] = acc
    if loss_scale is not None:
      record["loss_scale"] = loss_scale
    self.record("train", step, record)

  def eval_line(self, index: int, step: int, split: str, res: dict,
                train_s: float | None = None) -> None:
    """train_s: seconds of training so far, evaluations and saves excluded."""
    acc = res.get("acc")  # None: not counted (eval.accuracy=false)
    shown = f" | {split} acc {acc:.3f}" if acc is not None else ""
    self.info(f"| eval {index} at step {step} | {split} loss {res['loss']:.2f} "
              f"| {split} ppl {res['ppl']:.2f}{shown}")
    values = {k: res[k] for k in ("loss", "ppl", "acc")
              if res.get(k) is not None}
    if train_s is not None:
      values["train_s"] = train_s
    self.record(split, step, values)

  def summary(self, summary: dict, workdir: str,
              config_path: str | None = None) -> None:
    """The end-of-training block: what was reached and what to run next."""
    best = (f"{summary['best_valid_ppl']:.2f} at step "
            f"{summary['best_valid_step']}"
            if summary["best_valid_step"] is not None else "n/a")
    config = config_path or "CONFIG.py"
    rule = "-" * 89
    self.info(
        f"{rule}\n| end of training | steps {summary['steps']} | best valid ppl "
        f"{best} | tokens seen {summary['tokens_seen']:,} | wall "
        f"{summary['wall_s']:.0f}s | tok/s {summary['tok_per_s']:.0f}\n"
        f"| checkpoints: {summary['checkpoints']}\n"
        f"| evaluate:    python -m zebra_jax.main --config={config} "
        f"--workdir={workdir} --mode=eval\n"
        f"| sample:      python -m zebra_jax.main --config={config} "
        f"--workdir={workdir} --mode=sample --prompt='...'\n{rule}")
    self.record("summary", summary["steps"],
                 {k: v for k, v in summary.items() if k != "checkpoints"})

  def hparams(self, config: dict, metric_tags, step: int) -> None:
    """The run's config in TensorBoard's hparams dashboard, in the run's own
    directory (tensorboardX's add_hparams would open a subdirectory); the
    metric columns are the latest values of the scalars `metric_tags`.
    TensorBoard shows the first config a directory holds: the one the run
    started with, a resume's changed settings aside."""
    if self._tb is not None:
      _write_hparams(self._tb, flat_hparams(config), metric_tags, step)
      self._tb.flush()

  def text(self, tag: str, text: str, step: int) -> None:
    """Generated text etc. in TensorBoard's Text tab."""
    if self._tb is not None:
      self._tb.add_text(tag, text, step)

  def close(self) -> None:
    """Flushes and closes; a full disk here is already being reported."""
    for handle in (self._jsonl, self._tb):
      try:
        if handle is not None:
          handle.close()
      except OSError:
        pass
    self._jsonl = self._tb = None


def info(message: str) -> None:
  """One log line from process 0, above an open progress bar, if any."""
  if jax.process_index() == 0:
    progress.write(message)


def warning(message: str) -> None:
  """One warning line on stderr."""
  print(f"warning: {message}", file=sys.stderr, flush=True)


def error(message: str) -> None:
  """The one-line error every entry point prints for a UserError."""
  print(f"error: {message}", file=sys.stderr, flush=True)
