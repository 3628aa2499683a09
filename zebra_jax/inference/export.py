"""--mode=export: a portable artifact and a Triton model repository.

The artifact holds the model as two `jax.export` functions, serialized
StableHLO that a later JAX (6 months of backward compatibility) runs without
zebra_jax, Flax or the config code:

  prompt.jax   (params, carry, tokens int32 [b, t]) -> (last logits [b, V], carry)
  step.jax     (params, carry, tokens int32 [b])    -> (logits [b, V], carry)

With `model.head=adaptive` the "logits" are exact log-probabilities (a
softmax of them is the same distribution, so samplers need not care).
Batch `b` and prompt length `t` are symbolic, so one artifact serves any
batch. `params` is the flat list of arrays in params.npz (`leaf_00000`, ...),
passed in rather than baked in: the serialized functions stay small, and
a big model's weights do not hit protobuf's 2 GB limit. `carry` is one
(h, c) pair per layer, each float32 [b, hidden].

  export/
    artifact/    prompt.jax step.jax params.npz config.json, the tokenizer
                 (tokenizer.zebra.json; BPE adds the HF tokenizer.json),
                 manifest.json (shapes, platforms, jax version, and
                 every SamplingParams field's default: the config's sample
                 group with a fresh seed per request, as --mode=serve);
                 model.safetensors and model.json: the same parameters
                 named (embed, layers.0.w_x, ...) and the architecture,
                 for readers without zebra_jax (named_weights.py)
    triton/zebra_lstm/config.pbtxt   Triton Python backend; export.triton_instance
                                     picks CPU or GPU (auto: GPU if jax sees one)
                                     and an optional input per SamplingParams
                                     field
    triton/zebra_lstm/1/model.py     loads ./artifact (copied to 1/artifact)
    triton/zebra_lstm/1/engine/      the serving engine model.py runs
    triton/zebra_lstm/1/requirements.txt   what model.py's Python needs
"""

import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from zebra_jax.errors import UserError
from zebra_jax import engine as engines
from zebra_jax.inference import loading, named_weights, sample
from zebra_jax.model import lm
from zebra_jax import strict_json
from zebra_jax.runtime import distributed

_TRITON_TEMPLATES = os.path.join(os.path.dirname(__file__), "triton")
MODEL_NAME = "zebra_lstm"


def _functions(graphdef, treedef):
  """The two exported functions, over a flat parameter list."""

  def prompt(flat_params, carry, tokens):                     # tokens [b, t]
    params = jax.tree.unflatten(treedef, flat_params)
    return lm.last_logits(graphdef, params, tokens, carry)

  def step(flat_params, carry, tokens):                       # tokens [b]
    params = jax.tree.unflatten(treedef, flat_params)
    return lm.decode_step(params, carry, tokens, graphdef=graphdef)

  return prompt, step


def export_functions(loaded: loading.Loaded, platforms=("cpu",)):
  """(prompt Exported, step Exported, flat float32 params as numpy)."""
  leaves, treedef = jax.tree.flatten(loading.local_replica(loaded.params))
  flat = [np.asarray(jax.device_get(x)) for x in leaves]
  prompt, step = _functions(loaded.graphdef, treedef)
  b, t = jax.export.symbolic_shape("b, t")
  hidden, layers = loaded.cfg.model.hidden_size, loaded.cfg.model.num_layers
  param_specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
  state = jax.ShapeDtypeStruct((b, hidden), jnp.float32)
  carry_spec = tuple((state, state) for _ in range(layers))
  exp_prompt = jax.export.export(jax.jit(prompt), platforms=platforms)(
      param_specs, carry_spec, jax.ShapeDtypeStruct((b, t), jnp.int32))
  exp_step = jax.export.export(jax.jit(step), platforms=platforms)(
      param_specs, carry_spec, jax.ShapeDtypeStruct((b,), jnp.int32))
  return exp_prompt, exp_step, flat


def write_artifact(loaded: loading.Loaded, folder: str,
                   platforms=("cpu", "cuda")) -> dict:
  """Writes the artifact folder; returns its manifest."""
  try:
    exp_prompt, exp_step, flat = export_functions(loaded, platforms)
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f"jax.export failed for platforms {','.join(platforms)} "
                    f"({type(e).__name__}: {e})".splitlines()[0]) from None
  os.makedirs(folder, exist_ok=True)
  for name, exp in (("prompt.jax", exp_prompt), ("step.jax", exp_step)):
    with open(os.path.join(folder, name), "wb") as f:
      f.write(exp.serialize())
  np.savez(os.path.join(folder, "params.npz"),
           **{f"leaf_{i:05d}": x for i, x in enumerate(flat)})
  named_weights.write(folder, loading.local_replica(loaded.params),
                      loaded.cfg.model)
  loaded.tokenizer.save(folder)
  check_servable(loaded.tokenizer, folder)
  with open(os.path.join(folder, "config.json"), "w") as f:
    strict_json.dump(loaded.cfg.to_dict(), f, indent=2, sort_keys=True)
  m = loaded.cfg.model
  manifest = {
      "format": 1, "step": int(loaded.step), "jax_version": jax.__version__,
      "platforms": list(platforms), "num_params": len(flat),
      "num_layers": m.num_layers, "hidden_size": m.hidden_size,
      "vocab_size": m.vocab_size, "tokenizer": loaded.tokenizer.kind,
      "head": m.head,
      "outputs": ("log-probabilities" if m.head == "adaptive"
                  else "logits"),
      # Every SamplingParams field: the Triton model's per-request defaults.
      "sample": engines.wire.to_json(sample.serving_defaults(loaded.cfg)),
      "engine": sample.engine_options(loaded.cfg),  # serve.slots, ...
      "functions": {
          "prompt.jax": "(params, carry, tokens int32 [b, t]) -> "
                        "(last logits float32 [b, V], carry)",
          "step.jax": "(params, carry, tokens int32 [b]) -> "
                      "(logits float32 [b, V], carry)"},
      "carry": "one (h, c) pair per layer, each float32 [b, hidden_size]",
      "named_weights": {"weights": named_weights.WEIGHTS_FILE,
                        "architecture": named_weights.ARCHITECTURE_FILE},
  }
  with open(os.path.join(folder, "manifest.json"), "w") as f:
    strict_json.dump(manifest, f, indent=2)
  return manifest


def check_servable(tokenizer, folder: str) -> None:
  """Refuses an artifact whose tokenizer the Triton model (which does not
  import zebra_jax) cannot read back and decode exactly as `tokenizer` does."""
  spec = importlib.util.spec_from_file_location(
      "zebra_triton_model", os.path.join(_TRITON_TEMPLATES, "model.py"))
  triton_model = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(triton_model)
  try:
    served = triton_model.load_tokenizer(folder)
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f"the Triton model cannot load the {tokenizer.kind} "
                    f"tokenizer ({type(e).__name__}: {e})".splitlines()[0]
                    + ": export a workdir trained with data.tokenizer one of "
                    f"{', '.join(triton_model.TOKENIZERS)}") from None
  probe = list(range(min(tokenizer.vocab_size, 256)))
  if served.decode(probe) != tokenizer.decode(probe):
    raise UserError(f"the Triton model decodes the {tokenizer.kind} "
                    "tokenizer differently from zebra_jax: its model.py and "
                    "the package disagree; reinstall zebra_jax")


def instance_group(instance: str = "auto", gpus: str = "") -> tuple[str, str]:
  """(instance_group entry, a comment) for config.pbtxt.

  `instance`: cpu | gpu | auto (gpu when jax sees a GPU here, else cpu).
  `gpus`: e.g. "0,1" pins one instance to each listed GPU; "" puts one on
  every GPU Triton sees.
  """
  if instance not in ("auto", "cpu", "gpu"):
    raise UserError(f"export.triton_instance={instance!r} is not one of auto, "
                    "cpu, gpu: e.g. --config.export.triton_instance=cpu")
  ids = [g.strip() for g in str(gpus).split(",") if g.strip()]
  if any(not g.isdigit() for g in ids):
    raise UserError(f"export.triton_gpus={gpus!r} is not a list of GPU ids: "
                    "e.g. --config.export.triton_gpus=0,1")
  if instance == "auto":
    instance = "gpu" if _has_gpu() else "cpu"
  if instance == "cpu":
    if ids:
      raise UserError("export.triton_gpus is set but export.triton_instance "
                      "is cpu: use --config.export.triton_instance=gpu")
    return ("count: 1  kind: KIND_CPU",
            "One instance on the CPU (--config.export.triton_instance=gpu "
            "serves from GPUs).")
  if ids:
    return (f"count: 1  kind: KIND_GPU  gpus: [ {', '.join(ids)} ]",
            f"One instance on each of GPUs {', '.join(ids)}.")
  return ("count: 1  kind: KIND_GPU",
          "One instance on every GPU Triton sees (pin some with "
          "--config.export.triton_gpus=0,1; KIND_CPU serves from CPU).")


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:  # no GPU backend in this jax
    return False


def triton_inputs() -> str:
  """config.pbtxt's optional inputs, one per SamplingParams field; a field
  with no Triton encoding stops the export rather than vanish from it."""
  try:
    return engines.wire.config_inputs()
  except TypeError as e:
    raise UserError(f"{e}") from None


def requirements(tokenizer_kind: str) -> str:
  """requirements.txt for the Python that runs model.py."""
  lines = [
      "# What the Triton Python backend's Python needs to run model.py.",
      "# For GPU instances install jax with CUDA, e.g. jax[cuda12].",
      f"jax>={jax.__version__}",
      "numpy",
      "flatbuffers>=24.3  # jax.export deserialization"]
  if tokenizer_kind == "bpe":
    lines.append("tokenizers>=0.20")
  return "\n".join(lines) + "\n"


def write_triton_repository(artifact: str, repository: str,
                            max_batch_size: int = 64, instance: str = "auto",
                            gpus: str = "", queue_delay_us: int = 2000,
                            model_name: str = MODEL_NAME) -> str:
  """A Triton model repository around the artifact; returns the model folder
  (REPOSITORY/MODEL_NAME: several exports may share one repository)."""
  group, comment = instance_group(instance, gpus)
  sampling_inputs = triton_inputs()
  model_dir = os.path.join(repository, model_name)
  version_dir = os.path.join(model_dir, "1")
  os.makedirs(version_dir, exist_ok=True)
  with open(os.path.join(_TRITON_TEMPLATES, "config.pbtxt")) as f:
    config = f.read()
  config = (config.replace("{{name}}", model_name)
            .replace("{{max_batch_size}}", str(int(max_batch_size)))
            .replace("{{instance_group}}", group)
            .replace("{{instance_comment}}", comment)
            .replace("{{queue_delay_us}}", str(int(queue_delay_us)))
            .replace("{{sampling_inputs}}", sampling_inputs))
  with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
    f.write(config)
  shutil.copy(os.path.join(_TRITON_TEMPLATES, "model.py"),
              os.path.join(version_dir, "model.py"))
  engine_dir = os.path.join(version_dir, "engine")
  shutil.rmtree(engine_dir, ignore_errors=True)
  shutil.copytree(os.path.dirname(engines.__file__), engine_dir,
                  ignore=shutil.ignore_patterns("__pycache__"))
  with open(os.path.join(artifact, "manifest.json")) as f:
    kind = json.load(f)["tokenizer"]
  with open(os.path.join(version_dir, "requirements.txt"), "w") as f:
    f.write(requirements(kind))
  target = os.path.join(version_dir, "artifact")
  if os.path.abspath(artifact) != os.path.abspath(target):
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(artifact, target, copy_function=_link_or_copy)
  return model_dir


def _link_or_copy(src: str, dst: str) -> None:
  """A hard link costs no disk for big weights; copy across filesystems."""
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)


def run(cfg, workdir: str, export_dir: str | None = None) -> str:
  """--mode=export: WORKDIR/export/{artifact,triton}; returns the export dir."""
  export_dir = export_dir or os.path.join(workdir, "export")
  ex = cfg.export
  instance_group(ex.triton_instance, ex.triton_gpus)  # before loading
  triton_inputs()
  loaded = loading.load_for_inference(cfg, workdir)
  artifact = os.path.join(export_dir, "artifact")

  def write():  # once, by process 0; the others wait until it is written
    if jax.process_index() != 0:
      return None, None
    manifest = write_artifact(loaded, artifact)
    return manifest, write_triton_repository(
        artifact, os.path.join(export_dir, "triton"),
        max_batch_size=ex.triton_max_batch_size, instance=ex.triton_instance,
        gpus=ex.triton_gpus, queue_delay_us=ex.triton_queue_delay_us)

  manifest, model_dir = distributed.process_zero_first(write, "exporting")
  if jax.process_index() == 0:
    print(f"| export of step {manifest['step']} | artifact {artifact} "
          f"({', '.join(manifest['platforms'])}) | Triton model {model_dir}\n"
          f"  tritonserver --model-repository={os.path.dirname(model_dir)}\n"
          "  (or python -m zebra_jax.inference.triton_local "
          f"--model-repository={os.path.dirname(model_dir)}: docs/serving.md)",
          flush=True)
  return export_dir
