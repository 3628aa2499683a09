"""Command line: zebra-jax (or python -m zebra_jax.main) --config=demo.

Flags name things (what to run, where, which prompt); every number is a
config field, e.g. --config.model.num_stripes=8 or
--config.sample.temperature=0. --workdir defaults to runs/<config
name>[-<variant>]; every mode but train may leave out --config and use the
workdir's config.json, overrides applied to it. `zebra-jax fields
[SECTION]` lists the config fields; --help the flags by mode.
"""

import errno
import os
import sys

from absl import app, flags, logging

from zebra_jax.cli import arguments, entry, fields, usage
from zebra_jax.cli.modes import CONFIGLESS, MODES, NOUNS_READ
from zebra_jax.errors import UserError
from zebra_jax.runtime import distributed  # defines the multi-process flags
from zebra_jax.runtime import host_memory

_CONFIG = flags.DEFINE_string(
    "config", None, "Shipped config NAME[:variant] (base, demo, lm1b, "
    "wt103, e.g. demo:tiny) or a config file path[:variant]; outside "
    "--mode=train, default: the workdir's config.json. --config.x.y=v sets "
    "a field.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: config.json, tokenizer/, checkpoints/, "
    "metrics.jsonl (default: runs/<config name>[-<variant>]).")
_MODE = flags.DEFINE_enum(
    "mode", "train", list(MODES), "train (then evaluate valid/test and print "
    "a sample), eval, sample, score (texts), export (jax.export + Triton "
    "repository), serve (HTTP on localhost) or plot (loss/ppl curves PNG).")
_NOUNS = dict(
    prompt=flags.DEFINE_string("prompt", None, "sample: text to continue "
                               "(sets config.sample.prompt)."),
    prompt_file=flags.DEFINE_string(
        "prompt_file", None, "sample: one prompt per line, generated as a "
        "batch."),
    text=flags.DEFINE_multi_string("text", [], "score: a text to score "
                                   "(repeatable)."),
    text_file=flags.DEFINE_multi_string(
        "text_file", [], "score: a UTF-8 file scored as one text; eval: a "
        "file evaluated whole, instead of the corpus (repeatable)."),
    verbose=flags.DEFINE_boolean(
        "verbose", False, "score: also print every token's log-probability."),
    split=flags.DEFINE_enum("split", None, ["valid", "test", "all"],
                            "eval: which split(s) of the corpus (default "
                            "all = valid and test)."),
    export_dir=flags.DEFINE_string(
        "export_dir", None, "export: output folder (default WORKDIR/export)."),
    host=flags.DEFINE_string("host", "127.0.0.1", "serve: address to bind."),
    port=flags.DEFINE_integer("port", 8000, "serve: port; 0 picks a free one."),
    compare=flags.DEFINE_list("compare", [], "plot: more workdirs to overlay."),
    plot_out=flags.DEFINE_string(
        "plot_out", None, "plot: PNG path (default WORKDIR/curves.png)."),
)


def main(argv):
  """argv[1:]: the --config.x=y overrides, as (field, text) pairs.

  Returns the exit status: 0, or 75 when a signal stopped training before
  train.num_steps after saving a checkpoint (docs/reliability.md).
  """
  mode, nouns = _MODE.value, {k: f.value for k, f in _NOUNS.items()}
  for name, holder in _NOUNS.items():
    if flags.FLAGS[holder.name].present and name not in NOUNS_READ[mode]:
      read = ", ".join(f"--{noun}" for noun in NOUNS_READ[mode])
      print(f"warning: --{name}: --mode={mode} does not read it (it reads "
            f"{read}): ignored", file=sys.stderr, flush=True)
  try:  # read once, before JAX starts
    cfg, workdir = arguments.load(mode, _CONFIG.value, _WORKDIR.value, argv[1:],
                                  needs_config=mode not in CONFIGLESS)
  except UserError as e:
    entry.usage_error(str(e))
  if nouns["prompt"] is not None and cfg is not None:
    cfg.sample.prompt = nouns["prompt"]
  # Imported here so --help and flag errors answer before JAX starts.
  from zebra_jax.runtime import compile_cache, writer
  distributed.initialize()  # before any JAX backend starts
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  if mode not in CONFIGLESS:
    compile_cache.enable(workdir)  # before the first compile
  try:
    return MODES[mode](cfg, workdir, config=_CONFIG.value, **nouns)
  except UserError as e:
    _fail(writer, str(e))
  except OSError as e:
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES,
                       errno.EROFS):
      raise
    _fail(writer, f"{e.strerror}: {e.filename or workdir}: free disk space or "
          f"fix permissions, or point --workdir elsewhere")


def _fail(writer, message: str) -> None:
  """One line on stderr, exit code 2, without atexit hooks: in-flight saves
  have finished (loop.run waits for them), and after a full disk the hooks
  of tensorboardX and orbax would only print tracebacks of failed flushes."""
  writer.error(message)
  sys.stdout.flush()
  os._exit(2)  # pylint: disable=protected-access


def run():
  """The `zebra-jax` console script and python -m zebra_jax.main."""
  if sys.argv[1:2] == ["fields"]:
    sys.exit(fields.main(sys.argv[2:]))
  if entry.asks_short_help(sys.argv):
    program = [_CONFIG.name, _WORKDIR.name, _MODE.name,
               *(holder.name for holder in _NOUNS.values())]
    processes = [flag.name for flag in
                 flags.FLAGS.get_flags_for_module(distributed.__name__)]
    print(usage.text(program, processes))
    sys.exit(0)
  host_memory.reuse_freed_host_memory()  # before JAX starts its backend
  app.run(main, flags_parser=lambda argv: entry.parse_flags(
      argv, arguments.check_removed, own_overrides=True))


if __name__ == "__main__":
  run()
