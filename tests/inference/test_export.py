"""Export: the jax.export artifact in a fresh process, and the Triton model.py."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from zebra_jax.errors import UserError
from zebra_jax import engine
from zebra_jax.inference import export, loading, sample
from zebra_jax.engine import params as engine_params
from zebra_jax.model import lm
from tests.helpers import load_triton_model, triton_request

# Runs in a fresh interpreter: only jax and numpy, never zebra_jax or flax.
_FRESH = r"""
import json, sys
import jax, numpy as np
folder, out = sys.argv[1], sys.argv[2]
manifest = json.load(open(f"{folder}/manifest.json"))
prompt = jax.export.deserialize(bytearray(open(f"{folder}/prompt.jax", "rb").read()))
step = jax.export.deserialize(bytearray(open(f"{folder}/step.jax", "rb").read()))
npz = np.load(f"{folder}/params.npz")
params = [npz[f"leaf_{i:05d}"] for i in range(manifest["num_params"])]
tokens = np.load(f"{out}.in.npy")
zeros = np.zeros((tokens.shape[0], manifest["hidden_size"]), np.float32)
carry = tuple((zeros, zeros) for _ in range(manifest["num_layers"]))
last, carry = prompt.call(params, carry, tokens)
logits, carry = step.call(params, carry, tokens[:, -1])
assert not [m for m in sys.modules if m.startswith(("zebra_jax", "flax"))]
np.savez(out, last=np.asarray(last), logits=np.asarray(logits),
         h=np.asarray(carry[-1][0]))
"""


@pytest.fixture(scope="module")
def exported(char_run, tmp_path_factory):
  cfg, workdir = char_run
  export_dir = export.run(cfg, workdir, str(tmp_path_factory.mktemp("export")))
  return cfg, workdir, export_dir, loading.load_for_inference(cfg, workdir)


def test_artifact_in_a_fresh_process_gives_the_same_logits(exported, tmp_path):
  _, _, export_dir, loaded = exported
  folder = os.path.join(export_dir, "artifact")
  manifest = json.load(open(os.path.join(folder, "manifest.json")))
  assert manifest["platforms"] == ["cpu", "cuda"]
  # The same parameters, named, for readers without zebra_jax
  # (tests/inference/test_named_weights.py runs the docs' readers on them).
  from safetensors.numpy import load_file
  named = load_file(os.path.join(folder, "model.safetensors"))
  assert len(named) == manifest["num_params"] and "layers.1.u" in named
  assert json.load(open(os.path.join(folder, "model.json")))["head"] == "full"
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, loaded.cfg.model.vocab_size, (3, 11)).astype(np.int32)
  out = str(tmp_path / "fresh")
  np.save(f"{out}.in.npy", tokens)
  run = subprocess.run([sys.executable, "-c", _FRESH, folder, out],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert run.returncode == 0, run.stderr
  got = np.load(f"{out}.npz")
  carry = lm.init_carry(loaded.cfg.model, 3)
  logits, carry = lm.apply(loaded.graphdef, loaded.params, tokens, carry)
  np.testing.assert_allclose(got["last"], logits[:, -1], atol=1e-5)
  step_logits, carry = lm.apply(loaded.graphdef, loaded.params,
                                   tokens[:, -1:], carry)
  np.testing.assert_allclose(got["logits"], step_logits[:, 0], atol=1e-5)
  np.testing.assert_allclose(got["h"], carry[-1][0], atol=1e-5)


def texts_of(response):
  data, lengths = (t.as_numpy() for t in response.output_tensors[:2])
  return [bytes(row[:n]).decode() for row, n in zip(data, lengths[:, 0])]


def test_instance_groups_and_bad_export_settings():
  assert export.instance_group("cpu")[0] == "count: 1  kind: KIND_CPU"
  assert export.instance_group("gpu")[0] == "count: 1  kind: KIND_GPU"
  assert (export.instance_group("gpu", "0, 1")[0]
          == "count: 1  kind: KIND_GPU  gpus: [ 0, 1 ]")
  for args, words in ((("tpu",), "triton_instance='tpu'"),
                      (("gpu", "a"), "triton_gpus='a'"),
                      (("cpu", "0"), "triton_instance=gpu")):
    with pytest.raises(UserError, match=words):
      export.instance_group(*args)


def test_triton_model_execute_with_stand_in_requests(exported, monkeypatch):
  _, _, export_dir, loaded = exported
  model_dir = os.path.join(export_dir, "triton", export.MODEL_NAME)
  config = open(os.path.join(model_dir, "config.pbtxt")).read()
  assert 'backend: "python"' in config and "kind: KIND_CPU" in config  # auto
  requirements = open(os.path.join(model_dir, "1", "requirements.txt")).read()
  assert "flatbuffers" in requirements and "jax>=" in requirements
  assert "max_batch_size: 64" in config and "{{" not in config
  triton_model = load_triton_model(model_dir, monkeypatch)
  prompts = ["the ", "line 7: the quick"]
  greedy = triton_request(prompts, MAX_NEW_TOKENS=10, TEMPERATURE=0.0)
  sampled = triton_request(prompts[:1], MAX_NEW_TOKENS=10, TEMPERATURE=1.0,
                           SEED=3)
  bad = triton_request([""])
  responses = triton_model.execute([greedy, bad, sampled, sampled])
  assert len(responses) == 4
  assert responses[0].error is None, responses[0].error
  texts = texts_of(responses[0])
  gen = sample.Generator(loaded)
  expected = gen.generate(
      prompts, engine.SamplingParams(max_new_tokens=10, temperature=0.0))
  assert responses[0].error is None and texts == expected
  assert responses[1].error and "non-empty" in responses[1].error
  assert responses[1].output_tensors == []
  first, again = (texts_of(r)[0] for r in responses[2:])
  assert first == again and first.startswith("the ")  # seeded
  sampled_here = gen.generate(prompts[:1], engine.SamplingParams(
      max_new_tokens=10, temperature=1.0, top_p=loaded.cfg.sample.top_p,
      top_k=loaded.cfg.sample.top_k, seed=3))  # the model's defaults
  gen.close()
  assert [first] == sampled_here  # the same engine, the same random stream
  # Greedy and sampled rows ran in one batch: settings are per-row data.
  rows = [r.output_tensors[2].as_numpy()[0, 0] for r in responses[::2]]
  assert rows == [4, 4]
  assert sorted(os.listdir(os.path.join(model_dir, "1"))) == [
      "artifact", "engine", "model.py", "requirements.txt"]
  triton_model.finalize()


# Candidate values by annotation: the first within bounds and unlike the
# default is sent. A field of a new type fails here until it has one.
_CANDIDATES = {
    int: lambda d: [d + 1, 1],
    int | None: lambda d: [1, 2],
    float: lambda d: [d + 0.25, d - 0.25, 0.5],
    tuple[int, ...]: lambda d: [(3, 7)],
    tuple[str, ...]: lambda d: [("\n\n", "fox é")],
    tuple[tuple[int, float], ...]: lambda d: [((3, -2.5), (7, 1.0))],
}


def _unlike_default(field):
  for value in _CANDIDATES[field.type](field.default):
    if value != field.default and not engine_params.problem(field.name, value):
      return value
  raise AssertionError(f"no in-bounds example for {field.name}")


def _declared_inputs(config: str) -> dict:
  """config.pbtxt's optional inputs: {name: (data_type, dims)}."""
  return {m[1]: (m[2], m[3]) for m in re.finditer(
      r'name: "(\w+)"\s+data_type: (\w+)\s+dims: \[ ([^\]]*) \]\s+'
      r"optional: true", config)}


@pytest.fixture(scope="module")
def sampling_export(char_run, tmp_path_factory):
  """(model dir, serving defaults): the char run exported with min_p and
  the penalties set in its sample group."""
  cfg, workdir = char_run
  cfg = cfg.copy_and_resolve_references()
  cfg.sample.update(min_p=0.2, repetition_penalty=1.3, presence_penalty=0.4,
                    frequency_penalty=0.3, stop="fox")
  export_dir = export.run(cfg, workdir, str(tmp_path_factory.mktemp("ex")))
  return (os.path.join(export_dir, "triton", export.MODEL_NAME),
          sample.serving_defaults(cfg))


def test_every_sampling_field_is_a_triton_input_the_model_reads(
    sampling_export, monkeypatch):
  model_dir, defaults = sampling_export
  config = open(os.path.join(model_dir, "config.pbtxt")).read()
  declared = _declared_inputs(config)
  fields = dataclasses.fields(engine.SamplingParams)
  assert set(declared) == {f.name.upper() for f in fields}
  for f in fields:  # the type follows the field's annotation
    expected = {int: "TYPE_INT64", int | None: "TYPE_INT64",
                float: "TYPE_FP64"}.get(f.type)
    assert expected in (None, declared[f.name.upper()][0]), f.name
  assert declared["STOP"] == ("TYPE_UINT8", "-1")
  assert declared["LOGIT_BIAS"] == ("TYPE_FP64", "-1, 2")
  triton_model = load_triton_model(model_dir, monkeypatch)
  # Absent inputs: the export's defaults, --mode=serve's for this config.
  # (The model's SamplingParams is its own copy's class: compare values.)
  _, params = triton_model._read(triton_request(["the "]))
  assert dataclasses.asdict(params) == dataclasses.asdict(defaults)
  assert params.min_p == 0.2 and params.stop == ("fox",)
  text_only = triton_model.artifact.TEXT_ONLY
  assert text_only == ("logprobs", "prompt_logprobs")
  for f in fields:
    value = _unlike_default(f)
    request = triton_request(["the "], **{f.name.upper(): value})
    if f.name in text_only:
      with pytest.raises(ValueError, match=f"^{f.name.upper()}: .*drop it"):
        triton_model._read(request)
      continue
    _, params = triton_model._read(request)
    assert dataclasses.asdict(params) == dataclasses.asdict(
        dataclasses.replace(defaults, **{f.name: value})), f.name
  # A refused field or a value out of bounds fails its request, by name.
  responses = triton_model.execute([
      triton_request(["the "], LOGPROBS=1),
      triton_request(["the "], MIN_P=1.5),
      triton_request(["the "], MAX_NEW_TOKENS=3, MIN_P=0.0, STOP=())])
  assert responses[0].error.startswith("LOGPROBS: the Triton model returns")
  assert responses[1].error.startswith("MIN_P: must be a number in [0, 1]")
  assert responses[2].error is None and texts_of(responses[2])[0] != "the "
  triton_model.finalize()


def test_manifest_without_a_field_is_refused(sampling_export, tmp_path):
  model_dir, _ = sampling_export
  manifest = json.load(open(os.path.join(model_dir, "1", "artifact",
                                         "manifest.json")))
  assert set(manifest["sample"]) == {
      f.name for f in dataclasses.fields(engine.SamplingParams)}
  del manifest["sample"]["min_p"]
  with pytest.raises(ValueError, match=r"lacks \['min_p'\].*export again"):
    engine.wire.from_json(manifest["sample"])


def test_a_field_without_an_encoding_stops_the_export(monkeypatch):
  monkeypatch.delitem(engine.wire.ENCODINGS, tuple[str, ...])
  with pytest.raises(UserError, match=r"SamplingParams.stop .* ENCODINGS"):
    export.triton_inputs()
