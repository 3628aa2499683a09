"""Striped vs classic LSTM at equal wall-clock, over seeds.

Run by `python -m zebra_jax.tools.experiments` (launch/compare_stripes.sh).

Every setting trains the same config for the same wall-clock budget
(train.time_budget_minutes), then its best checkpoint is scored on the whole
valid and test splits by `evaluate.run`, the path --mode=eval takes. Settings:
num_stripes in --stripes at the config's hidden size, plus a classic LSTM
(S = 1) whose hidden size gives the parameter count of the most striped one
(`matched_hidden`); with --grouped, grouped stripe counts too
(model.stripe_input=grouped), and a classic LSTM matched to the most striped
grouped one.

Fairness rules, because a budget only means something if it binds:
- num_steps = measured steps/s x budget x margin, from a short calibration run
  per setting, so the clock stops each run and the cosine schedule is most of
  the way down when it does (warmup is capped at 10% of those steps).
- A one-step priming run with the timed run's exact config fills a persistent
  XLA compilation cache (the schedule's step counts are compiled in), so the
  budget pays for training, not for compiling, which differs per setting.
- Runs go seed-major (all settings for seed 0, then seed 1, ...), so a shared
  machine's load drifts over every setting alike rather than one.

Output in --out: results.md (the table), results.json (table + every run),
valid_ppl_vs_time.png, and runs/<setting>_seed<k>/ workdirs. A run whose
workdir already holds run.json is not repeated: rerun the command to resume.
"""

import dataclasses
import json
import math
import os
import statistics
import time
from typing import Sequence

import ml_collections

from zebra_jax.benchmarks import stripes_report

# The calibration run: windows of steps after the first (which compiles), and
# the median window's rate is the estimate (robust to one noisy window).
_CALIBRATION_WINDOWS, _CALIBRATION_WINDOW_STEPS = 4, 5


@dataclasses.dataclass(frozen=True)
class Setting:
  """One line of the comparison: a stripe count and input kind at a width."""
  num_stripes: int
  hidden_size: int
  embed_size: int
  classic_matched: bool = False  # the S = 1 at a striped parameter count
  stripe_input: str = "dense"    # model.stripe_input: "dense" | "grouped"

  @property
  def name(self) -> str:
    grouped = "_grouped" if self.stripe_input == "grouped" else ""
    suffix = "_matched" if self.classic_matched else ""
    return f"s{self.num_stripes}{grouped}_h{self.hidden_size}{suffix}"


def apply_setting(cfg, setting: Setting) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.model.update(num_stripes=setting.num_stripes,
                   hidden_size=setting.hidden_size,
                   embed_size=setting.embed_size,
                   stripe_input=setting.stripe_input)
  return cfg


def param_count(cfg, setting: Setting) -> int:
  """Parameters of the model `setting` builds (shapes only, nothing allocated).

  cfg.model.vocab_size must be filled in (see `vocab_size`).
  """
  import jax
  from zebra_jax.model import lm
  _, params = lm.abstract(apply_setting(cfg, setting).model)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def with_vocab_size(cfg, workdir: str) -> ml_collections.ConfigDict:
  """cfg with model.vocab_size from the tokenizer (cached in workdir/data)."""
  from zebra_jax.data import pipeline
  tokenizer, _ = pipeline.prepare_data(cfg, workdir)
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  cfg.model.vocab_size = tokenizer.vocab_size
  return cfg


def matched_hidden(cfg, target_params: int) -> int:
  """Classic (S = 1) hidden size whose parameter count is nearest the target.

  The embedding follows the hidden size when the config ties them (embed_size
  == hidden_size), so the classic model is the same family, only narrower.
  Parameters grow monotonically with width: bisect, then take the nearer side.
  """
  tied = cfg.model.embed_size == cfg.model.hidden_size
  def count(h):
    return param_count(cfg, Setting(1, h, h if tied else cfg.model.embed_size))
  low, high = 1, 4 * cfg.model.hidden_size
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if count(mid) <= target_params else (low, mid)
  return min((low, high), key=lambda h: abs(count(h) - target_params))


def make_settings(cfg, stripes: Sequence[int], classic: bool,
                  grouped: Sequence[int] = ()) -> list[Setting]:
  """Dense then grouped stripe counts at the config's widths, plus classic.

  The classic LSTM comes once per family (dense, grouped), matched to the
  parameter count of that family's most striped model.
  """
  hidden, embed = cfg.model.hidden_size, cfg.model.embed_size
  families = [[Setting(s, hidden, embed) for s in stripes],
              [Setting(s, hidden, embed, stripe_input="grouped")
               for s in grouped]]
  settings = [s for family in families for s in family]
  for family in families:
    most_striped = max(family, key=lambda s: s.num_stripes, default=None)
    if classic and most_striped and most_striped.num_stripes > 1:
      h = matched_hidden(cfg, param_count(cfg, most_striped))
      matched = Setting(1, h, h if embed == hidden else embed, True)
      if matched not in settings:
        settings.append(matched)
  return settings


def _run_config(cfg, setting, seed, **train):
  """cfg for one in-process run: no eval/sample report (scored separately)."""
  cfg = apply_setting(cfg, setting)
  cfg.seed = seed
  cfg.train.update(report_at_end=False, **train)
  return cfg


def _fresh(workdir: str) -> None:
  """Removes what an interrupted earlier attempt left in workdir."""
  if os.path.exists(workdir):
    import shutil
    shutil.rmtree(workdir)


def calibrate(cfg, setting: Setting, workdir: str) -> float:
  """Steps per second of `setting` on this machine now (compile excluded)."""
  from zebra_jax.runtime import plots
  from zebra_jax.training import loop
  window = _CALIBRATION_WINDOW_STEPS
  steps = window * (_CALIBRATION_WINDOWS + 1)
  cfg = _run_config(cfg, setting, cfg.seed, num_steps=steps, log_every=window,
                    eval_every=steps, time_budget_minutes=0.0,
                    eval_max_batches=1)
  cfg.checkpoint.every_steps = steps  # a save inside a window would skew it
  _fresh(workdir)
  loop.run(cfg, workdir)
  rates = [1000.0 / r["ms_per_batch"] for r in plots.read_metrics(workdir)
           if r["kind"] == "train"]
  return statistics.median(rates[1:])  # the first window still warms up


def timed_config(cfg, setting, seed, steps_per_s, budget_minutes, margin,
                 eval_points, curve_eval_batches) -> ml_collections.ConfigDict:
  """The config of one timed run: steps sized so the budget binds."""
  num_steps = max(2, math.ceil(steps_per_s * budget_minutes * 60 * margin))
  eval_every = max(1, num_steps // eval_points)
  run_cfg = _run_config(
      cfg, setting, seed, num_steps=num_steps, eval_every=eval_every,
      log_every=max(1, min(cfg.train.log_every, eval_every // 2)),
      time_budget_minutes=float(budget_minutes),
      eval_max_batches=curve_eval_batches)
  run_cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, num_steps // 10)
  run_cfg.checkpoint.every_steps = num_steps + 1  # evals save; nothing else
  return run_cfg


def prime(run_cfg, workdir: str) -> None:
  """One step + one evaluation of exactly run_cfg: compiles into the cache."""
  from zebra_jax.training import loop
  _fresh(workdir)
  cfg = ml_collections.ConfigDict(run_cfg.to_dict())
  cfg.train.time_budget_minutes = 1e-9  # stops after the first step
  loop.run(cfg, workdir)


def train_and_score(run_cfg, setting: Setting, workdir: str) -> dict:
  """One timed run + the identical final evaluation; returns its record."""
  from zebra_jax.runtime import plots
  from zebra_jax.training import evaluate, loop
  launched = time.time()
  summary = loop.run(run_cfg, workdir)
  scores = evaluate.run(run_cfg, workdir)
  records = plots.read_metrics(workdir)
  rates = [r["tok_per_s"] for r in records if r["kind"] == "train"]
  tokens_per_step = run_cfg.data.batch_size * run_cfg.data.seq_len
  record = {
      "setting": setting.name, "num_stripes": setting.num_stripes,
      "stripe_input": setting.stripe_input,
      "hidden_size": setting.hidden_size, "embed_size": setting.embed_size,
      "classic_matched": setting.classic_matched, "seed": run_cfg.seed,
      "params": summary["params"], "planned_steps": run_cfg.train.num_steps,
      "steps": summary["steps"], "wall_s": summary["wall_s"],
      "launched": launched,
      "tokens_seen": summary["steps"] * tokens_per_step,
      "tok_per_s": sum(rates) / len(rates) if rates else float("nan"),
      "valid_ppl": scores["valid"]["ppl"], "test_ppl": scores["test"]["ppl"],
      "valid_loss": scores["valid"]["loss"], "test_loss": scores["test"]["loss"],
  }
  with open(os.path.join(workdir, "run.json"), "w") as f:
    json.dump(record, f, indent=2)
  return record


def run(cfg, out: str, budget_minutes: float = 1.5,
        seeds: Sequence[int] = (0, 1, 2), stripes: Sequence[int] = (1, 2, 4, 8),
        classic: bool = True, margin: float = 1.2, eval_points: int = 5,
        curve_eval_batches: int = 10, compile_cache: bool = True,
        grouped: Sequence[int] = ()) -> dict:
  """Runs (or resumes) the whole comparison; returns the results dict.

  Args:
    cfg: the base config (e.g. configs/demo.py); model widths come from it.
    stripes, grouped: num_stripes values run with dense and with grouped
      stripe input.
    budget_minutes: wall-clock per run, compile cache warm (the knob for GPUs).
    margin: num_steps = steps/s x budget x margin; > 1 so the budget binds.
    eval_points: in-loop valid evaluations per run (the curves' points).
    curve_eval_batches: valid windows per in-loop evaluation (they count
      against the budget); 0 = the whole split. The table always scores the
      whole valid and test splits.
    compile_cache: keep compiled steps in OUT/xla_cache. JAX reads this once,
      at the process's first compile, so in-process callers that compiled
      before (tests) pass False.
  """
  import jax
  os.makedirs(out, exist_ok=True)
  if compile_cache:  # priming compiles, the timed runs load
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(out, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  settings = make_settings(with_vocab_size(cfg, os.path.join(out, "vocab")),
                           stripes, classic, grouped)
  rates_path = os.path.join(out, "steps_per_s.json")
  rates = {}
  if os.path.exists(rates_path):
    with open(rates_path) as f:
      rates = json.load(f)
  configs = {}
  for setting in settings:
    if setting.name not in rates:
      rates[setting.name] = calibrate(
          cfg, setting, os.path.join(out, "calibration", setting.name))
      with open(rates_path, "w") as f:
        json.dump(rates, f, indent=2)
    configs[setting.name] = timed_config(
        cfg, setting, cfg.seed, rates[setting.name], budget_minutes, margin,
        eval_points, curve_eval_batches)
  primed = set()
  records = []
  for seed in seeds:  # Seed-major: machine load drifts over all settings.
    for setting in settings:
      workdir = os.path.join(out, "runs", f"{setting.name}_seed{seed}")
      done = os.path.join(workdir, "run.json")
      if os.path.exists(done):
        with open(done) as f:
          records.append(json.load(f))
        continue
      _fresh(workdir)  # A run cut off mid-way starts afresh, not resumed.
      if setting.name not in primed:  # once per process: the cache persists
        prime(configs[setting.name], os.path.join(out, "priming",
                                                  setting.name))
        primed.add(setting.name)
      run_cfg = ml_collections.ConfigDict(configs[setting.name].to_dict())
      run_cfg.seed = seed
      records.append(train_and_score(run_cfg, setting, workdir))
  meta = {"budget_minutes": budget_minutes, "seeds": list(seeds),
          "calibrated_steps_per_s": rates, "margin": margin,
          "machine": stripes_report.machine(),
          "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
  return stripes_report.write(out, records, meta)
