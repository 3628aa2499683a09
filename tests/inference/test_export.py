"""Export: the jax.export artifact in a fresh process, and the Triton model.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from zebra_jax.errors import UserError
from zebra_jax.inference import engine, export, loading, sample
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
