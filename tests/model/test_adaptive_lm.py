"""ZebraLM with the adaptive softmax head: equal to the full head without
cutoffs, the chunked loss agrees with the log-probabilities `apply` returns,
and a wt103.py:tiny run trains, evaluates, samples, scores and exports."""

import json
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from zebra_jax.config import base, files
from zebra_jax.errors import UserError
from zebra_jax.inference import export, loading, sample, score
from zebra_jax.model import lm
from zebra_jax.runtime import rundir, writer
from zebra_jax.training import evaluate, loop
from tests import references as ref
from tests.helpers import tiny_word_config, write_wikitext

V, H = 23, 16


def _cfg(**overrides) -> ml_collections.ConfigDict:
  c = base.get_config().model.to_dict()  # every field, then this test's
  c.update(vocab_size=V, embed_size=H, hidden_size=H, num_layers=2,
           num_stripes=2, dropout_embed=0.0, dropout_hidden=0.0,
           dropout_output=0.0, tie_embeddings=True, dtype="float32",
           unroll=1, remat=False, head="adaptive", adaptive_cutoffs=(4, 9, 15),
           adaptive_div_val=2, adaptive_tie=True, adaptive_chunk_rows=8)
  c.update(overrides)
  return ml_collections.ConfigDict(c)


def _data(cfg, batch=3, time=9, seed=1):
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, time + 1)),
                    jnp.int32)
  carry = tuple((jnp.asarray(rng.uniform(-.5, .5, (batch, cfg.hidden_size)),
                             jnp.float32),) * 2 for _ in range(cfg.num_layers))
  return ids[:, :-1], ids[:, 1:], carry


@pytest.mark.parametrize("tie", [True, False])
def test_no_cutoffs_is_the_full_head_with_the_same_weights(tie):
  full_cfg = _cfg(head="full", tie_embeddings=tie)
  adaptive_cfg = _cfg(adaptive_cutoffs=(), adaptive_div_val=1,
                      adaptive_tie=tie)
  full_graphdef, full = ref.random_model(full_cfg, seed=0)
  adaptive_graphdef, adaptive = ref.random_model(adaptive_cfg, seed=5)
  assert all(x.size for x in jax.tree.leaves(adaptive))  # orbax saves no empties
  adaptive_lm = nnx.merge(adaptive_graphdef, adaptive)
  for i, layer in enumerate(adaptive_lm.layers):  # copy every weight across
    for name in ("w_x", "w_h", "b"):
      getattr(layer, name)[...] = full["layers"][i][name][...]
  head = adaptive_lm.adaptive_softmax
  if tie:
    assert "embed" not in adaptive and "head_w" not in full
    head.weights.tables[0][...] = full["embed"][...]  # the input too
  else:
    adaptive_lm.embed[...] = full["embed"][...]
    head.weights.tables[0][...] = full["head_w"][...].T
  head.biases[0][...] = full["head_b"][...]
  adaptive_graphdef, adaptive = nnx.split(adaptive_lm)

  inputs, targets, carry = _data(full_cfg)
  logits, full_carry = lm.apply(full_graphdef, full, inputs, carry)
  log_probs, carry2 = lm.apply(adaptive_graphdef, adaptive, inputs, carry)
  np.testing.assert_allclose(log_probs, jax.nn.log_softmax(logits, -1),
                             atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               full_carry, carry2)
  want, _ = lm.token_sums(full_graphdef, full, inputs, targets, carry)
  got, _ = lm.token_sums(adaptive_graphdef, adaptive, inputs, targets, carry)
  assert got["loss_sum"] == pytest.approx(float(want["loss_sum"]), rel=1e-5)
  assert got["correct"] == want["correct"] and got["count"] == want["count"]


def test_chunked_loss_agrees_with_the_log_probabilities_of_apply():
  cfg = _cfg()
  graphdef, params = ref.random_model(cfg, seed=0)
  assert "adaptive_input" in params and "embed" not in params  # tied
  inputs, targets, carry = _data(cfg, batch=4, time=7)
  for start, stop in ((0, 4), (4, 9), (9, 15), (15, V)):  # every cluster
    assert ((targets >= start) & (targets < stop)).any()

  @jax.jit  # one compile for every path
  def paths(params):
    out = {}
    out["log_probs"], out["carry_apply"] = lm.apply(graphdef, params,
                                                       inputs, carry)
    out["sums"], out["carry_sums"] = lm.token_sums(graphdef, params, inputs,
                                                      targets, carry)
    out["cheap"], _ = lm.token_sums(graphdef, params, inputs, targets,
                                       carry, with_accuracy=False)
    out["per_token"], _ = lm.target_log_probs(graphdef, params, inputs,
                                                 targets, carry)
    return out

  out = paths(params)
  log_probs, sums = out["log_probs"], out["sums"]
  assert log_probs.shape == (4, 7, V) and log_probs.dtype == jnp.float32
  np.testing.assert_allclose(jnp.exp(log_probs).sum(-1), 1.0, rtol=1e-5)
  gathered = jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  assert float(sums["loss_sum"]) == pytest.approx(float(-gathered.sum()),
                                                  rel=1e-5)
  assert float(sums["correct"]) == float(
      (jnp.argmax(log_probs, -1) == targets).sum())
  assert float(sums["count"]) == targets.size
  jax.tree.map(np.testing.assert_array_equal, out["carry_apply"],
               out["carry_sums"])
  assert "correct" not in out["cheap"]
  assert out["cheap"]["loss_sum"] == sums["loss_sum"]
  np.testing.assert_allclose(out["per_token"], gathered, atol=1e-5)


def test_gradients_of_the_chunked_loss_match_the_dense_log_probabilities():
  """Through the tied input, the LSTM and every cluster, with dropout."""
  cfg = _cfg(dropout_embed=0.2, dropout_output=0.3)
  graphdef, params = ref.random_model(cfg, seed=0)
  inputs, targets, carry = _data(cfg)
  key = jax.random.key(3)

  def chunked(p):
    return lm.token_sums(graphdef, p, inputs, targets, carry, key,
                            with_accuracy=False)[0]["loss_sum"]

  def dense(p):
    log_probs, _ = lm.apply(graphdef, p, inputs, carry, key)
    return -jnp.take_along_axis(log_probs, targets[..., None], -1).sum()

  got, want = jax.jit(lambda p: (jax.grad(chunked)(p), jax.grad(dense)(p)))(
      params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(g)) and np.abs(w).max() > 0
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_untied_when_widths_differ():
  cfg = _cfg(embed_size=12)  # adaptive_tie asks, but E != H: a plain table
  _, params = lm.abstract(cfg)
  assert params["embed"].shape == (V, 12)
  assert "adaptive_input" not in params
  assert params["adaptive_softmax"]["weights"]["tables"][0].shape == (4, H)


def test_configs_without_a_head_field_mean_the_full_head(tmp_path):
  """Workdirs from before the adaptive head keep loading as what they were,
  even where today's default head would be another."""
  old = {k: v for k, v in _cfg(head="adaptive").items()
         if k != "head" and not k.startswith("adaptive_")}
  saved = files.upgrade({"model": old})
  assert saved.model.head == "full"
  _, params = lm.abstract(saved.model)
  assert "head_b" in params and "adaptive_softmax" not in params
  new = _cfg(head="full")
  rundir._check_same_architecture(saved, new, str(tmp_path))  # same model
  new.head = "adaptive"
  with pytest.raises(UserError, match="model.head=full"):
    rundir._check_same_architecture(saved, new, str(tmp_path))
  # Cutoffs come back from JSON as lists; they are the same cutoffs.
  saved = files.upgrade(json.loads(json.dumps({"model": new.to_dict()})))
  rundir._check_same_architecture(saved, new, str(tmp_path))
  new.adaptive_cutoffs = (4, 10, 15)
  with pytest.raises(UserError, match="adaptive_cutoffs"):
    rundir._check_same_architecture(saved, new, str(tmp_path))


def test_train_log_without_accuracy(tmp_path):
  log = writer.MetricWriter(str(tmp_path), tensorboard=False)
  common = dict(epoch=1, batch=1, batches=2, lr=1e-3, ms_per_batch=1.0,
                tok_per_s=1.0, loss=1.0, ppl=2.7, grad_norm=1.0)
  log.train_line(step=1, acc=None, **common)
  log.train_line(step=2, acc=0.5, **common)
  log.close()
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert "acc" not in records[0] and records[1]["acc"] == 0.5


# ------------------------------------------------ wt103.py:tiny end to end

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("adaptive")
  cfg = tiny_word_config(write_wikitext(tmp / "wt"))
  cfg.train.update(num_steps=40, eval_every=20, eval_max_batches=0)
  workdir = str(tmp / "run")
  summary = loop.run(cfg, workdir)
  return cfg, workdir, summary


@pytest.mark.slow
def test_tiny_wt103_run_trains_evaluates_and_samples(trained):
  cfg, workdir, summary = trained
  saved = json.load(open(f"{workdir}/config.json"))["model"]
  assert saved["head"] == "adaptive" and saved["adaptive_cutoffs"] == [8, 16]
  vocab = saved["vocab_size"]
  assert vocab > 16  # three clusters really exist
  records = [json.loads(l) for l in open(f"{workdir}/metrics.jsonl")]
  train_records = [r for r in records if r["kind"] == "train"]
  assert train_records[-1]["loss"] < train_records[0]["loss"] - 0.25
  assert not any("acc" in r for r in train_records)  # not computed: not shown
  valid = [r for r in records if r["kind"] == "valid"]
  assert valid and 0.0 < valid[-1]["acc"] <= 1.0

  results = evaluate.run(cfg, workdir, splits_to_eval=("valid",))["valid"]
  assert results["loss"] == pytest.approx(summary["best_valid_loss"], rel=1e-5)
  assert np.isfinite(results["ppl"]) and results["ppl"] < 0.8 * vocab
  [res] = score.run(cfg, workdir, texts=["the cat sat on a mat"])
  assert np.isfinite(res["ppl"])

  cfg.sample.update(prompt="the cat", max_new_tokens=6, temperature=0.0)
  [text] = sample.run(cfg, workdir)
  assert text.startswith("the cat ")
  assert len(re.findall(r"[^ \n]+|\n", text)) == 2 + 6  # <eos> is "\n"


def test_export_of_the_adaptive_head_matches_apply(trained):
  cfg, workdir, _ = trained
  loaded = loading.load_for_inference(cfg, workdir)
  prompt, step, flat = export.export_functions(loaded)
  tokens = np.random.default_rng(0).integers(
      0, loaded.cfg.model.vocab_size, (2, 5)).astype(np.int32)
  carry = lm.init_carry(loaded.cfg.model, 2)
  last, carry1 = prompt.call(flat, carry, tokens)
  want, carry2 = lm.apply(loaded.graphdef, loaded.params, tokens, carry)
  np.testing.assert_allclose(last, want[:, -1], atol=1e-5)
  np.testing.assert_allclose(np.exp(last).sum(-1), 1.0, rtol=1e-5)
  out, _ = step.call(flat, carry1, tokens[:, -1])
  want, _ = lm.apply(loaded.graphdef, loaded.params, tokens[:, -1:], carry2)
  np.testing.assert_allclose(out, want[:, 0], atol=1e-5)


def test_eval_without_accuracy_and_with_a_token_limit(trained):
  """eval.accuracy=false: the same loss, no acc anywhere; eval.max_tokens:
  the first tokens of every row, named in the report and the record."""
  cfg, workdir, _ = trained
  on = evaluate.run(cfg, workdir, ("valid",))["valid"]
  off_cfg = cfg.copy_and_resolve_references()
  off_cfg.eval.accuracy = False
  off = evaluate.run(off_cfg, workdir, ("valid",))["valid"]
  assert 0.0 < on["acc"] <= 1.0 and off["acc"] is None
  assert off["loss"] == pytest.approx(on["loss"], rel=1e-6)
  assert off["tokens"] == on["tokens"] == on["split_tokens"]
  assert "acc" not in evaluate.summary_block("valid", 40, off, False)
  off_cfg.eval.max_tokens = 8 * 5  # eval.batch_size 8: 5 tokens a row
  cut = evaluate.run(off_cfg, workdir, ("valid",))["valid"]
  assert cut["tokens"] == 40 and cut["split_tokens"] == on["tokens"]
  records = [json.loads(l) for l in open(f"{workdir}/metrics.jsonl")]
  final = [r for r in records if r["kind"] == "final_valid"]
  assert "acc" in final[-3] and "acc" not in final[-1]
  assert final[-1]["tokens"] == 40
  assert final[-1]["split_tokens"] == on["tokens"]
