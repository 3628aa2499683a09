"""Run output: log lines on stdout, metrics.jsonl and TensorBoard scalars.

Only process 0 writes; the others stay quiet, so a multi-host run prints and
records each step once.

TensorBoard is optional: event files come from tensorboardX when it is
installed, else from the `tensorboard` package's own event writer (scalars and
text, nothing else is written), else not at all. Each fallback says so in one
warning line on stderr; metrics.jsonl is written either way.
"""

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
  add_scalar/add_text/close subset of tensorboardX's SummaryWriter."""

  def __init__(self, logdir: str):
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
    from tensorboard.summary.writer import event_file_writer
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    self._tensor_pb2, self._shape_pb2 = tensor_pb2, tensor_shape_pb2
    self._writer = event_file_writer.EventFileWriter(logdir)

  def _add(self, step: int, value) -> None:
    self._writer.add_event(self._event_pb2.Event(
        wall_time=time.time(), step=int(step),
        summary=self._summary_pb2.Summary(value=[value])))

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

  def close(self) -> None:
    self._writer.close()


_warned = set()  # each fallback warns once per process, not once per run


def summary_writer(logdir: str):
  """tensorboardX's SummaryWriter, else EventWriter, else None; a fallback
  prints one warning line on stderr (once per process)."""
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    return SummaryWriter(logdir)
  except ImportError:
    pass
  try:
    writer = EventWriter(logdir)
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


class MetricWriter:
  """Transformer-XL style log lines plus one JSON record per line."""

  def __init__(self, workdir: str, tensorboard: bool = True):
    self.active = jax.process_index() == 0
    self._jsonl = self._tb = None
    if self.active:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
      if tensorboard:
        self._tb = summary_writer(os.path.join(workdir, "tensorboard"))

  def info(self, message: str) -> None:
    if self.active:
      progress.write(message)  # above an open progress bar, if any

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


def warning(message: str) -> None:
  """One warning line on stderr."""
  print(f"warning: {message}", file=sys.stderr, flush=True)


def error(message: str) -> None:
  """The one-line error every entry point prints for a UserError."""
  print(f"error: {message}", file=sys.stderr, flush=True)
