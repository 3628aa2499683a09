"""Command line: zebra-jax (or python -m zebra_jax.main) --config=configs/demo.py.

Flags name things (what to run, where, which prompt); the config holds numbers.
Any config field can be overridden, e.g. --config.model.num_stripes=8.
--workdir defaults to runs/<config name>[-<variant>]; every mode but train
may leave out --config and use the workdir's config.json.
"""

import errno
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from zebra_jax.cli import arguments, entry
from zebra_jax.errors import UserError
from zebra_jax.runtime import distributed  # defines the multi-process flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/demo.py or "
    "configs/wt103.py:tiny; outside --mode=train, default: the workdir's "
    "config.json.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: config.json, tokenizer/, checkpoints/, "
    "metrics.jsonl (default: runs/<config name>[-<variant>]).")
_MODE = flags.DEFINE_enum(
    "mode", "train",
    ["train", "eval", "sample", "score", "export", "serve", "infer_bench",
     "plot", "bench"],
    "train (then evaluate valid/test and print a sample), eval, sample, score "
    "(texts), export (jax.export + Triton repository), serve (HTTP on "
    "localhost), infer_bench (generation throughput and latency), plot "
    "(loss/ppl curves PNG) or bench (training speed vs PyTorch; takes "
    "zebra_jax.tools.bench's flags, e.g. --quick, --shape, --memory).")
_PLOT_OUT = flags.DEFINE_string("plot_out", None,
                                "plot: PNG path (default WORKDIR/curves.png).")
_COMPARE = flags.DEFINE_list("compare", [], "plot: more workdirs to overlay.")
_SPLIT = flags.DEFINE_enum("split", "all", ["valid", "test", "all"],
                           "eval: which split(s); all = valid and test.")
_TEXT = flags.DEFINE_multi_string("text", [], "score: a text to score "
                                  "(repeatable).")
_TEXT_FILE = flags.DEFINE_multi_string(
    "text_file", [], "score: a UTF-8 file scored as one text (repeatable).")
_VERBOSE = flags.DEFINE_boolean(
    "verbose", False, "score: also print every token's log-probability.")
_PROMPT_FILE = flags.DEFINE_string(
    "prompt_file", None, "sample: one prompt per line, generated as a batch.")
_REPETITION_PENALTY = flags.DEFINE_float(
    "repetition_penalty", None, "sample: > 1 discourages tokens already in "
    "the text (1 = off).")
_STOP = flags.DEFINE_string("stop", None, "sample: end each text before this "
                            "string; \\n and \\t stand for newline and tab.")
_STREAM = flags.DEFINE_boolean("stream", None, "sample: print tokens as they "
                               "are generated.")
_STREAM_CHUNK = flags.DEFINE_integer(
    "stream_chunk", None, "sample: tokens per jitted call (stream and stop "
    "granularity).")
_EXPORT_DIR = flags.DEFINE_string(
    "export_dir", None, "export: output folder (default WORKDIR/export).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "serve: address to bind.")
_PORT = flags.DEFINE_integer("port", 8000, "serve: port; 0 picks a free one.")
_BENCH_BATCH_SIZES = flags.DEFINE_list(
    "bench_batch_sizes", ["1", "2", "4", "8", "16", "32", "64"],
    "infer_bench: batch sizes to measure.")
_BENCH_NEW_TOKENS = flags.DEFINE_integer(
    "bench_new_tokens", 64, "infer_bench: tokens generated per request.")
_BENCH_PROMPT_LEN = flags.DEFINE_integer(
    "bench_prompt_len", 32, "infer_bench: prompt tokens per request.")
_BENCH_REQUESTS = flags.DEFINE_integer(
    "bench_requests", 5, "infer_bench: timed requests per batch size.")
_BENCH_JSON = flags.DEFINE_string(
    "bench_json", None, "infer_bench: JSON output (default "
    "WORKDIR/infer_bench.json).")
_PROMPT = flags.DEFINE_string("prompt", None, "sample: text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None,
                                "sample: tokens to generate.")
_TEMPERATURE = flags.DEFINE_float(
    "temperature", None, "sample: softmax temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", None, "sample: keep the k most likely "
                              "tokens (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", None, "sample: nucleus mass to keep "
                            "(1 = off).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", None,
                                    "sample: continuations to draw.")
_SEED = flags.DEFINE_integer("seed", None, "sample: random seed.")


def _sample_overrides(cfg):
  """Sampling flags given on the command line win over config.sample."""
  given = {"prompt": _PROMPT, "max_new_tokens": _MAX_NEW,
           "temperature": _TEMPERATURE, "top_k": _TOP_K, "top_p": _TOP_P,
           "num_samples": _NUM_SAMPLES, "seed": _SEED,
           "repetition_penalty": _REPETITION_PENALTY, "stop": _STOP,
           "stream": _STREAM, "chunk": _STREAM_CHUNK}
  with cfg.unlocked():
    for field, flag in given.items():
      if flag.value is not None:
        cfg.sample[field] = flag.value
    if _STOP.value:  # a shell passes "\n" as two characters
      cfg.sample.stop = _STOP.value.replace("\\n", "\n").replace("\\t", "\t")
  return cfg


def main(argv):
  del argv  # Everything comes from flags.
  # Imported here so --help and flag errors answer before JAX starts.
  from zebra_jax.runtime import writer
  distributed.initialize()  # before any JAX backend starts
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  cfg, workdir = _CONFIG.value, _WORKDIR.value
  if cfg is not None:
    cfg = _sample_overrides(cfg)
  if workdir and _MODE.value not in ("plot", "bench"):
    from zebra_jax.runtime import compile_cache
    compile_cache.enable(workdir)  # before the first compile
  try:
    _dispatch(_MODE.value, cfg, workdir)
  except UserError as e:
    _fail(writer, str(e))
  except OSError as e:
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES,
                       errno.EROFS):
      raise
    _fail(writer, f"{e.strerror}: {e.filename or workdir}: free disk space or "
          f"fix permissions, or point --workdir elsewhere")


def _fail(writer, message: str) -> None:
  """One line on stderr, exit code 2.

  Exits without running atexit hooks: by now in-flight checkpoint saves have
  finished (loop.run waits for them), and after a full disk the hooks of
  tensorboardX and orbax would only print tracebacks of failed flushes.
  """
  writer.error(message)
  sys.stdout.flush()
  os._exit(2)  # pylint: disable=protected-access


def _dispatch(mode: str, cfg, workdir: str) -> None:
  if mode in ("train", "eval", "sample"):
    from zebra_jax.inference import sample
    from zebra_jax.training import evaluate, loop
  if mode == "train":
    config_path = next((a.split("=", 1)[1] for a in sys.argv  # for hints
                        if a.startswith("--config=")), None)
    summary = loop.run(cfg, workdir, config_path)
    if cfg.train.report_at_end and not summary["preempted"]:
      evaluate.run(cfg, workdir)
      sample.run(cfg, workdir)
  elif mode == "eval":
    evaluate.run(cfg, workdir, _SPLIT.value)
  elif mode == "sample":
    prompts = (sample.read_prompt_file(_PROMPT_FILE.value)
               if _PROMPT_FILE.value else None)
    sample.run(cfg, workdir, prompts)
  elif mode == "score":
    from zebra_jax.inference import score
    score.run(cfg, workdir, _TEXT.value, _TEXT_FILE.value, _VERBOSE.value)
  elif mode == "export":
    from zebra_jax.inference import export
    export.run(cfg, workdir, _EXPORT_DIR.value)
  elif mode == "serve":
    from zebra_jax.inference import serve
    serve.run(cfg, workdir, _HOST.value, _PORT.value)
  elif mode == "infer_bench":
    from zebra_jax.tools import infer_bench
    infer_bench.run(cfg, workdir, _BENCH_BATCH_SIZES.value,
                    new_tokens=_BENCH_NEW_TOKENS.value,
                    prompt_len=_BENCH_PROMPT_LEN.value,
                    requests=_BENCH_REQUESTS.value,
                    json_path=_BENCH_JSON.value)
  elif mode == "plot":
    from zebra_jax.tools import plot
    print(plot.run([workdir, *_COMPARE.value], _PLOT_OUT.value))
  else:  # bench's own flags were defined by _parse_flags
    from zebra_jax.tools import bench
    f = flags.FLAGS
    bench.run(f.quick, f.shape, f.json or (workdir and os.path.join(
        workdir, "bench.json")), f.rounds, f.memory, f.trace_dir)


def _parse_flags(argv: list[str]):
  """The forgiving defaults (arguments.resolve), then absl's parser."""
  if arguments.flag_value(argv, "mode") == "bench":
    from zebra_jax.tools import bench  # pylint: disable=unused-import  # its flags
  return entry.parse_flags(argv, arguments.resolve)


def run():
  """The `zebra-jax` console script and python -m zebra_jax.main."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
