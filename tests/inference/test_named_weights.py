"""model.safetensors and model.json: names, and the docs' readers against
the model's own logits (jax alone; torch.nn.LSTM for one stripe)."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from zebra_jax.configs import demo
from zebra_jax.inference import loading, named_weights
from zebra_jax.model import lm
from tests.helpers import python_block


def _model_cfg(**fields):
  cfg = demo.get_config("tiny").model
  cfg.update(vocab_size=23, **fields)
  return cfg


def _model_logits(model_cfg, params, tokens):
  graphdef, _ = lm.abstract(model_cfg)
  carry = lm.init_carry(model_cfg, tokens.shape[0])
  return np.asarray(lm.apply(graphdef, params, tokens, carry)[0])


def _tokens(vocab, shape=(3, 9)):
  return np.random.default_rng(0).integers(0, vocab, shape).astype(np.int32)


def test_the_trained_run_exports_what_the_docs_reader_runs(char_run, tmp_path):
  cfg, workdir = char_run
  loaded = loading.load_for_inference(cfg, workdir)
  named_weights.write(str(tmp_path), loaded.params, loaded.cfg.model)
  space = {}
  exec(python_block("docs/python-api.md", "def zebra_logits"), space)  # pylint: disable=exec-used
  tokens = _tokens(loaded.cfg.model.vocab_size)
  np.testing.assert_allclose(
      space["zebra_logits"](str(tmp_path), tokens),
      _model_logits(loaded.cfg.model, loaded.params, tokens), atol=2e-5)
  arch = json.load(open(tmp_path / "model.json"))
  assert arch["num_stripes"] == 4 and arch["head"] == "full"
  assert arch["model"]["hidden_size"] == loaded.cfg.model.hidden_size
  assert sorted(load_file(str(tmp_path / "model.safetensors"))) == [
      "embed", "head.bias", "layers.0.bias", "layers.0.u", "layers.0.w_x",
      "layers.1.bias", "layers.1.u", "layers.1.w_x"]


@pytest.mark.parametrize("fields", [
    dict(stripe_input="grouped", tie_embeddings=False),  # shuffled stripes
    dict(stripe_input="grouped", embed_size=18),         # a dense first layer
    dict(num_stripes=1, num_layers=3)])
def test_the_jax_reader_on_other_layouts(fields, tmp_path):
  model_cfg = _model_cfg(**fields)
  _, params = lm.create(model_cfg, seed=1)
  named_weights.write(str(tmp_path), params, model_cfg)
  space = {}
  exec(python_block("docs/python-api.md", "def zebra_logits"), space)  # pylint: disable=exec-used
  tokens = _tokens(23)
  np.testing.assert_allclose(space["zebra_logits"](str(tmp_path), tokens),
                             _model_logits(model_cfg, params, tokens),
                             atol=2e-5)


@pytest.mark.parametrize("fields", [dict(), dict(tie_embeddings=False),
                                    dict(stripe_input="grouped",
                                         embed_size=16)])
def test_one_stripe_loads_into_torch_lstm(fields, tmp_path):
  torch = pytest.importorskip("torch")
  model_cfg = _model_cfg(num_stripes=1, **fields)
  _, params = lm.create(model_cfg, seed=2)
  named_weights.write(str(tmp_path), params, model_cfg)
  space = {}
  exec(python_block("docs/python-api.md", "def torch_modules"), space)  # pylint: disable=exec-used
  embedding, lstm, head = space["torch_modules"](str(tmp_path))
  tokens = _tokens(23)
  with torch.no_grad():
    got = head(lstm(embedding(torch.from_numpy(tokens).long()))[0]).numpy()
  np.testing.assert_allclose(got, _model_logits(model_cfg, params, tokens),
                             atol=2e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_adaptive_names_are_distinct_and_round_trip(tie):
  model_cfg = _model_cfg(head="adaptive", adaptive_cutoffs=(8, 15),
                         adaptive_tie=tie)
  _, params = lm.create(model_cfg, seed=3)
  arrays = named_weights.named(params)
  assert len(arrays) == len(jax.tree.leaves(params))
  assert "adaptive.tables.2" in arrays and "adaptive.cluster_w" in arrays
  assert ("embed" in arrays) == (not tie)
  again = named_weights.from_named(arrays, params)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  assert named_weights.architecture(model_cfg)["outputs"] == (
      "log-probabilities")
