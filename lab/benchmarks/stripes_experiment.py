"""Striped vs classic LSTM: time to perplexity at equal wall-clock, over seeds.

Run by `python -m lab.experiments` (launch/compare_stripes.sh).

Every setting trains the same config for the same wall-clock budget
(train.time_budget_minutes), then its best checkpoint is scored on the whole
valid and test splits by `evaluate.run`, the path --mode=eval takes. Settings
(`make_settings`), in this order:
- the classic LSTM (S = 1) at the config's hidden size H;
- dense stripe counts (--stripes) and grouped ones (--grouped) at H;
- grouped stripe counts (--equal_time) at the width whose step costs what
  the classic LSTM's does (`equal_time_width`, from measured steps/s): the
  grouped trade is a wider model for the same step time;
- classic LSTMs narrowed to the parameter count of the most striped dense
  and the most striped grouped model at H (`matched_hidden`).

Fairness rules, because a budget only means something if it binds:
- num_steps = measured steps/s x budget x margin, from a short calibration run
  per setting, so the clock stops each run and the cosine schedule is most of
  the way down when it does (warmup is capped at 10% of those steps).
- A one-step priming run with the timed run's exact config fills a persistent
  XLA compilation cache (the schedule's step counts are compiled in), so the
  budget pays for training, not for compiling, which differs per setting.
- Start-up (data, model, restore) is measured apart; the curves' clock is
  training time: the loop's valid records carry `train_s`, which leaves out
  the time spent evaluating and saving.
- Runs go seed-major (all settings for seed 0, then seed 1, ...), so a shared
  machine's load drifts over every setting alike rather than one.

Output in --out, small enough to commit: plan.json (the settings, their
calibrated steps/s and the width search; made once, then reused, so a
resumed experiment runs the same models), results.json (every run's record
with its valid curve), results.md and valid_ppl_vs_time.png. Workdirs go to
OUT/workdirs/ (git-ignored). A run recorded in results.json or in its
workdir's run.json is not repeated: rerun the command, on this machine or
another, to resume.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import ml_collections

from lab.benchmarks import stripes_report
from zebra_jax.errors import UserError
from zebra_jax import strict_json

# The calibration run: windows of steps after the first (which compiles), and
# the median window's rate is the estimate (robust to one noisy window).
_CALIBRATION_WINDOWS, _CALIBRATION_WINDOW_STEPS = 4, 5


@dataclasses.dataclass(frozen=True)
class Setting:
  """One line of the comparison: a stripe count and input kind at a width."""
  num_stripes: int
  hidden_size: int
  embed_size: int
  stripe_input: str = "dense"  # model.stripe_input: "dense" | "grouped"
  role: str = ""  # "" | "matched" (classic at a striped parameter count)
  #                 | "equal_time" (grouped, widened to the classic step time)

  @property
  def name(self) -> str:
    grouped = "_grouped" if self.stripe_input == "grouped" else ""
    suffix = {"": "", "matched": "_matched", "equal_time": "_eqtime"}[self.role]
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


def _at_width(cfg, num_stripes: int, width: int, stripe_input: str,
              role: str) -> Setting:
  """The config's model family at another width: a tied embedding (embed_size
  == hidden_size) follows the hidden size, an untied one keeps its size."""
  tied = cfg.model.embed_size == cfg.model.hidden_size
  return Setting(num_stripes, width, width if tied else cfg.model.embed_size,
                 stripe_input, role)


def matched_hidden(cfg, target_params: int) -> int:
  """Classic (S = 1) hidden size whose parameter count is nearest the target.

  Parameters grow monotonically with width: bisect, then take the nearer side.
  """
  def count(h):
    return param_count(cfg, _at_width(cfg, 1, h, "dense", "matched"))
  low, high = 1, 4 * cfg.model.hidden_size
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if count(mid) <= target_params else (low, mid)
  return min((low, high), key=lambda h: abs(count(h) - target_params))


def equal_time_width(steps_per_s: Callable[[int], float], width: int,
                     rate: float, target_rate: float, multiple: int,
                     tries: int = 4, tolerance: float = 0.05
                     ) -> tuple[int, list[tuple[int, float]]]:
  """The width (a multiple of `multiple`) whose steps/s is nearest target_rate.

  Step time grows with width by a power law whose exponent depends on the
  machine (per-step overheads flatten it on a CPU), so the search is a secant
  in log-log space from the known point (width, rate): each guess is
  measured with `steps_per_s(w)` and refits the exponent, until a measured
  rate is within `tolerance` or `tries` runs out. Returns the nearest width
  measured and every (width, steps/s) measured, the known point first.
  """
  measured = [(width, rate)]
  exponent = 1.5  # between overhead-bound (0) and FLOP-bound (2) steps
  for _ in range(tries):
    w0, r0 = measured[-1]
    if abs(r0 / target_rate - 1) <= tolerance:
      break
    guess = w0 * (r0 / target_rate) ** (1 / exponent)
    w = max(multiple, multiple * round(guess / multiple))
    if any(w == m for m, _ in measured):
      break
    measured.append((w, steps_per_s(w)))
    (wa, ra), (wb, rb) = measured[-2], measured[-1]
    if ra != rb:
      exponent = min(3.0, max(0.3, math.log(ra / rb) / math.log(wb / wa)))
  best = min(measured, key=lambda m: abs(math.log(m[1] / target_rate)))
  return best[0], measured


def make_settings(cfg, stripes: Sequence[int], classic: bool,
                  grouped: Sequence[int] = ()) -> list[Setting]:
  """The classic LSTM, then dense and grouped stripe counts at the config's
  width, then (classic=True) the parameter-matched classic LSTMs, one per
  family (dense, grouped) matched to that family's most striped model.
  Equal-time settings are added by `make_plan`: they need measurements.
  """
  hidden = cfg.model.hidden_size
  families = [[_at_width(cfg, s, hidden, "dense", "") for s in stripes],
              [_at_width(cfg, s, hidden, "grouped", "") for s in grouped]]
  settings = sorted((s for family in families for s in family),
                    key=lambda s: s.num_stripes > 1)  # classic first
  for family in families:
    most_striped = max(family, key=lambda s: s.num_stripes, default=None)
    if classic and most_striped and most_striped.num_stripes > 1:
      h = matched_hidden(cfg, param_count(cfg, most_striped))
      matched = _at_width(cfg, 1, h, "dense", "matched")
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


def make_plan(cfg, scratch: str, stripes: Sequence[int], grouped: Sequence[int],
              equal_time: Sequence[int], classic: bool) -> dict:
  """Settings and their calibrated steps/s, equal-time widths searched."""
  settings = make_settings(cfg, stripes, classic, grouped)
  rates = {}
  def rate(setting):
    if setting.name not in rates:
      rates[setting.name] = calibrate(
          cfg, setting, os.path.join(scratch, "calibration", setting.name))
    return rates[setting.name]
  for setting in settings:
    rate(setting)
  searches = {}
  if equal_time:
    classic_h = next((s for s in settings
                      if s.num_stripes == 1 and not s.role), None)
    if classic_h is None:
      raise UserError("--equal_time needs the classic LSTM: put 1 in --stripes")
    hidden = cfg.model.hidden_size
    for s in equal_time:
      at = lambda w, s=s: _at_width(cfg, s, w, "grouped", "equal_time")
      start = _at_width(cfg, s, hidden, "grouped", "")
      width, measured = equal_time_width(
          lambda w: rate(at(w)), hidden, rate(start), rate(classic_h),
          multiple=max(s, 8))
      searches[str(s)] = measured
      if width != hidden:  # otherwise the setting at H is already in the list
        settings.insert(len([x for x in settings if x.role != "matched"]),
                        at(width))
  return {"settings": [dataclasses.asdict(s) for s in settings],
          "steps_per_s": {s.name: rates[s.name] for s in settings},
          "width_search": searches, "vocab_size": cfg.model.vocab_size}


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


def train_and_score(run_cfg, setting: Setting, workdir: str) -> dict | None:
  """One timed run + the identical final evaluation; returns its record, or
  None when a stop signal (SIGTERM, SIGINT) ended the run early: a cut-off
  run is no result."""
  from zebra_jax.runtime import plots
  from zebra_jax.training import evaluate, loop
  launched = time.time()
  summary = loop.run(run_cfg, workdir)
  if summary["preempted"]:
    return None
  scores = evaluate.run(run_cfg, workdir)
  records = plots.read_metrics(workdir)
  rates = [r["tok_per_s"] for r in records if r["kind"] == "train"]
  curve = [{"step": r["step"], "train_s": r["train_s"], "ppl": r["ppl"]}
           for r in records if r["kind"] == "valid" and "train_s" in r]
  tokens_per_step = run_cfg.data.batch_size * run_cfg.data.seq_len
  record = {
      "setting": setting.name, "num_stripes": setting.num_stripes,
      "stripe_input": setting.stripe_input, "role": setting.role,
      "hidden_size": setting.hidden_size, "embed_size": setting.embed_size,
      "seed": run_cfg.seed,
      "params": summary["params"], "planned_steps": run_cfg.train.num_steps,
      "steps": summary["steps"], "wall_s": summary["wall_s"],
      "train_s": summary["train_s"],
      "startup_s": plots.start_time(records) - launched,
      "launched": launched,
      "tokens_seen": summary["steps"] * tokens_per_step,
      "tok_per_s": sum(rates) / len(rates) if rates else float("nan"),
      "valid_ppl": scores["valid"]["ppl"], "test_ppl": scores["test"]["ppl"],
      "valid_loss": scores["valid"]["loss"], "test_loss": scores["test"]["loss"],
      "curve": curve,
  }
  with open(os.path.join(workdir, "run.json"), "w") as f:
    strict_json.dump(record, f, indent=2)
  return record


def _load_json(path: str):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _plan(cfg, out, scratch, request) -> dict:
  """OUT/plan.json if it was made for this request, else a new one."""
  path = os.path.join(out, "plan.json")
  plan = _load_json(path)
  if plan is not None:
    if plan["request"] != request:
      raise UserError(
          f"{path} was made for other settings ({plan['request']}): pass a "
          f"new --out, or delete {path} and its results to start over")
    return plan
  plan = make_plan(cfg, scratch, request["stripes"], request["grouped"],
                   request["equal_time"], request["classic"])
  plan["request"] = request
  with open(path, "w") as f:
    strict_json.dump(plan, f, indent=2)
  return plan


def run(cfg, out: str, budget_minutes: float = 3.25,
        seeds: Sequence[int] = (0, 1, 2), stripes: Sequence[int] = (1, 4, 8),
        classic: bool = True, margin: float = 1.2, eval_points: int = 12,
        curve_eval_batches: int = 10, compile_cache: bool = True,
        grouped: Sequence[int] = (), equal_time: Sequence[int] = (),
        targets: Sequence[float] = ()) -> dict:
  """Runs (or resumes) the whole comparison; returns the results dict.

  Args:
    cfg: the base config (e.g. the demo config); model widths come from it.
    stripes, grouped: num_stripes values run with dense and with grouped
      stripe input at the config's width.
    equal_time: grouped num_stripes values also run at the width whose step
      time equals the classic LSTM's (1 must be in `stripes`).
    budget_minutes: wall-clock per run, compile cache warm (the knob for GPUs).
    margin: num_steps = steps/s x budget x margin; > 1 so the budget binds.
    eval_points: in-loop valid evaluations per run (the curves' points).
    curve_eval_batches: valid windows per in-loop evaluation (they count
      against the budget, not against the curves' training time); 0 = the
      whole split. The table always scores the whole valid and test splits.
    compile_cache: keep compiled steps in OUT/workdirs/xla_cache. JAX reads
      this once, at the process's first compile, so in-process callers that
      compiled before (tests) pass False.
    targets: the perplexities whose time-to-reach is reported; empty = the
      rule in `stripes_report.auto_targets`.
  """
  import jax
  scratch = os.path.join(out, "workdirs")
  os.makedirs(scratch, exist_ok=True)
  if compile_cache:  # priming compiles, the timed runs load
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(scratch, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  cfg = with_vocab_size(cfg, os.path.join(scratch, "vocab"))
  request = {"stripes": list(stripes), "grouped": list(grouped),
             "equal_time": list(equal_time), "classic": classic,
             "budget_minutes": budget_minutes, "margin": margin,
             "eval_points": eval_points,
             "curve_eval_batches": curve_eval_batches,
             "config": cfg.to_dict()}
  request = json.loads(json.dumps(request))  # as plan.json reads back
  plan = _plan(cfg, out, scratch, request)
  settings = [Setting(**s) for s in plan["settings"]]
  earlier = _load_json(os.path.join(out, "results.json")) or {"runs": []}
  done = {(r["setting"], r["seed"]): r for r in earlier["runs"]}
  meta = {"budget_minutes": budget_minutes, "seeds": list(seeds),
          "calibrated_steps_per_s": plan["steps_per_s"],
          "width_search": plan["width_search"], "margin": margin,
          "targets": list(targets),
          "machine": stripes_report.machine(),
          "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}"}
  primed = set()
  for seed in seeds:  # Seed-major: machine load drifts over all settings.
    for setting in settings:
      workdir = os.path.join(scratch, "runs", f"{setting.name}_seed{seed}")
      if (setting.name, seed) in done:
        continue
      if (record := _load_json(os.path.join(workdir, "run.json"))) is None:
        _fresh(workdir)  # A run cut off mid-way starts afresh, not resumed.
        run_cfg = timed_config(cfg, setting, seed,
                               plan["steps_per_s"][setting.name],
                               budget_minutes, margin, eval_points,
                               curve_eval_batches)
        if setting.name not in primed:  # once per process: the cache persists
          prime(run_cfg, os.path.join(scratch, "priming", setting.name))
          primed.add(setting.name)
        record = train_and_score(run_cfg, setting, workdir)
        if record is None:
          print(f"stopped during {setting.name} seed {seed}; rerun the same "
                f"command to resume (that run starts afresh)", file=sys.stderr)
          return stripes_report.write(out, _in_order(done, settings), meta)
      done[(setting.name, seed)] = record
      # Written after every run, so an interrupted experiment keeps its runs.
      stripes_report.write(out, _in_order(done, settings), meta)
  return stripes_report.write(out, _in_order(done, settings), meta)


def _in_order(done: dict, settings: Sequence[Setting]) -> list[dict]:
  """The records in the plan's setting order, then by seed."""
  order = {s.name: i for i, s in enumerate(settings)}
  return [done[k] for k in sorted(done, key=lambda k: (order.get(k[0], 1e9),
                                                       k[1]))]
