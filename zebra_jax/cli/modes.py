"""What each --mode runs: MODES[mode](cfg, workdir, **nouns).

A mode may return an exit status (train does); None means 0.

Every function takes the config, the workdir and the command line's nouns
(which prompt file, which texts, where to export...) by keyword, and uses
the ones its mode needs. Modules are imported inside so that `--help` and
flag errors answer before JAX starts.
"""


def train(cfg, workdir, *, config, **_):
  """Trains; then, unless stopped early, evaluates valid/test and samples.

  Returns the exit status: preemption.EXIT_STOPPED_EARLY when a signal
  stopped the run before train.num_steps (a checkpoint is saved), else 0.
  """
  from zebra_jax.inference import sample
  from zebra_jax.training import evaluate, loop, preemption
  summary = loop.run(cfg, workdir, config)  # config: for the printed hints
  if cfg.train.report_at_end and not summary["preempted"]:
    evaluate.run(cfg, workdir)
    sample.run(cfg, workdir, preview=True)
  return preemption.exit_status(summary["stopped_early"])


def evaluate(cfg, workdir, *, split, text_file, **_):
  """The corpus' splits (--split, default all), or whole --text_file files."""
  from zebra_jax import api
  from zebra_jax.errors import UserError
  from zebra_jax.training import evaluate as evaluation
  if split and text_file:
    raise UserError("--split picks the corpus' splits and --text_file "
                    "evaluates whole files: pass one of them")
  evaluation.split_names(split or "all")  # before a checkpoint loads
  evaluation.check_text_files(text_file)
  with api.load(workdir, config=cfg) as model:
    evaluation.run(cfg, workdir, split or "all", text_files=text_file,
                   loaded=model.loaded)


def sample(cfg, workdir, *, prompt_file, **_):
  from zebra_jax import api
  from zebra_jax.inference import sample as sampling
  prompts = sampling.read_prompt_file(prompt_file) if prompt_file else None
  params, prompts = sampling.checked_request(cfg, prompts)
  with api.load(workdir, config=cfg) as model:
    sampling.show(cfg, model.step, prompts, params,
                  lambda on_text: model.generate(
                      prompts, params, num_samples=int(cfg.sample.num_samples),
                      on_text=on_text))


def score(cfg, workdir, *, text, text_file, verbose, **_):
  from zebra_jax import api
  from zebra_jax.inference import score as scoring
  named = scoring.read_texts(text, text_file)
  with api.load(workdir, config=cfg) as model:
    scoring.report(named, model.score([t for _, t in named]), verbose)


def export(cfg, workdir, *, export_dir, **_):
  from zebra_jax.inference import export as exporting
  exporting.run(cfg, workdir, export_dir)


def serve(cfg, workdir, *, host, port, **_):
  from zebra_jax.serving import serve as serving
  serving.run(cfg, workdir, host, port)


def plot(cfg, workdir, *, compare, plot_out, **_):
  del cfg  # curves come from the workdirs' metrics.jsonl
  from zebra_jax.runtime import plots as plotting
  plotting.run([workdir, *compare], plot_out)


MODES = {"train": train, "eval": evaluate, "sample": sample, "score": score,
         "export": export, "serve": serve, "plot": plot}
# Modes that read no config (neither --config nor the workdir's config.json).
CONFIGLESS = ("plot",)
# The command line's nouns each mode reads (a flag given to another mode is
# warned about); which config fields it reads is config/mode_fields.py.
NOUNS_READ = {"train": ("prompt",), "eval": ("split", "text_file"),
              "sample": ("prompt", "prompt_file"),
              "score": ("text", "text_file", "verbose"),
              "export": ("export_dir",), "serve": ("host", "port"),
              "plot": ("compare", "plot_out")}
