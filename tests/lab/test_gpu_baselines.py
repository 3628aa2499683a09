"""The kernel stage's baselines on a CPU, as far as a CPU allows: the jax
cuDNN row's weight layout against the scan's math through jax's own
reference LSTM, its step traced, its row an error row with one line off
CUDA; FlashRNN's row says why it cannot run; a baseline that raises is a
row that says why and the others are timed."""

import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import rnn

from lab.benchmarks import cudnn_jax, flashrnn_rows, gpu_kernel, gpu_results
from lab.benchmarks.shapes import SHAPES
from zebra_jax.model.recurrence import scan

TINY = {**SHAPES["quick"], "hidden": 8, "batch": 2, "seq_len": 3}


def _layer_args(s, t, b, g, n_in, grouped, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(0.5 * rng.standard_normal(shape),
                                   jnp.float32)
  inputs = arr(s, t, b, n_in // s) if grouped else arr(t, b, n_in)
  w_x = arr(s, n_in // s, 4 * g) if grouped else arr(n_in, s, 4 * g)
  return inputs, w_x, arr(s, 4 * g), arr(s, b, g), arr(s, b, g), \
      arr(s, g, 4 * g)


@pytest.mark.parametrize("stripes,grouped", [(1, False), (2, False),
                                             (2, True)])
def test_packed_stripes_run_the_scans_math(stripes, grouped):
  """Each stripe's weights packed for cuDNN, unpacked by jax's helper and
  run by jax's reference LSTM (the semantics its cuDNN op implements):
  the scan's outputs and final state, stripe by stripe."""
  t, b, g, n_in = 4, 3, 5, 6
  inputs, w_x, bias, h0, c0, w_h = _layer_args(stripes, t, b, g, n_in,
                                               grouped)
  ys, h, c = scan.zebra_layer(inputs, w_x, bias, h0, c0, w_h, 1, False)
  for s in range(stripes):
    x_s = inputs[s] if grouped else inputs        # [T, B, in]
    width_in = x_s.shape[-1]
    flat = cudnn_jax.pack(*([m] for m in cudnn_jax.stripe_matrices(
        w_x, w_h, bias, s, grouped)))
    assert flat.shape == (rnn.get_num_params_in_lstm(width_in, g, 1, False),)
    w_ih, w_hh, b_ih, b_hh = rnn.unpack_lstm_weights(flat, width_in, g, 1,
                                                     False)
    y_ref, h_ref, c_ref = rnn.lstm_ref(
        jnp.swapaxes(x_s, 0, 1), h0[s][None], c0[s][None], w_ih, w_hh, b_ih,
        b_hh, jnp.full((b,), t, jnp.int32), width_in, g, 1, 0.0, False)
    np.testing.assert_allclose(ys[s], jnp.swapaxes(y_ref, 0, 1), atol=1e-5)
    np.testing.assert_allclose(h[s], h_ref[0], atol=1e-5)
    np.testing.assert_allclose(c[s], c_ref[0], atol=1e-5)


def test_a_gate_order_slip_is_caught():
  """The control: f and i swapped in W_hh changes the reference's output,
  so the test above would see a layout that reads the gates wrongly."""
  inputs, w_x, bias, h0, c0, w_h = _layer_args(1, 4, 3, 5, 6, False)
  w_ih, w_hh, b_ih, b_hh = cudnn_jax.stripe_matrices(w_x, w_h, bias, 0, False)
  swapped = jnp.concatenate([w_hh[5:10], w_hh[:5], w_hh[10:]])
  lengths = jnp.full((3,), 4, jnp.int32)
  run = lambda hh: rnn.lstm_ref(
      jnp.swapaxes(inputs, 0, 1), h0, c0, {0: w_ih}, {0: hh}, {0: b_ih},
      {0: b_hh}, lengths, 6, 5, 1, 0.0, False)[0]
  assert float(jnp.max(jnp.abs(run(w_hh) - run(swapped)))) > 1e-3


def test_pack_orders_layers_as_cudnn_does():
  """Two layers: every layer's matrices, then every layer's biases; jax's
  unpacking gives each back."""
  rng = np.random.default_rng(1)
  h, n_in = 3, 4
  mats = {"w_ih": [rng.standard_normal((4 * h, n_in)),
                   rng.standard_normal((4 * h, h))],
          "w_hh": [rng.standard_normal((4 * h, h)) for _ in range(2)],
          "b_ih": [rng.standard_normal(4 * h) for _ in range(2)],
          "b_hh": [rng.standard_normal(4 * h) for _ in range(2)]}
  flat = cudnn_jax.pack(mats["w_ih"], mats["w_hh"], mats["b_ih"],
                        mats["b_hh"])
  assert flat.shape == (rnn.get_num_params_in_lstm(n_in, h, 2, False),)
  for got, name in zip(rnn.unpack_lstm_weights(flat, n_in, h, 2, False),
                       ("w_ih", "w_hh", "b_ih", "b_hh")):
    for layer in range(2):
      np.testing.assert_allclose(got[layer], mats[name][layer], rtol=1e-6)


def test_jax_cudnn_step_runs_one_lstm_per_stripe(monkeypatch):
  """The row's step with rnn.lstm replaced by jax's reference of it (the
  op itself has no CPU lowering): S LSTMs of width H/S, each with all its
  layers in one call at the row's precision; the step trains (a finite
  loss that falls)."""
  calls = []

  def reference_lstm(x, h_0, c_0, weights, seq_lengths, input_size,
                     hidden_size, num_layers, dropout, bidirectional,
                     precision):
    calls.append((x.shape, input_size, hidden_size, num_layers, precision))
    w = rnn.unpack_lstm_weights(weights, input_size, hidden_size, num_layers,
                                bidirectional)
    return rnn.lstm_ref(x, h_0, c_0, *w, seq_lengths, input_size,
                        hidden_size, num_layers, dropout, bidirectional)
  monkeypatch.setattr(rnn, "lstm", reference_lstm)
  jitted, args, _ = cudnn_jax.train_step(TINY, 2, "tf32")
  assert [w.shape for w in args[0]] == [
      (rnn.get_num_params_in_lstm(4, 4, TINY["layers"], False),)] * 2
  losses = []
  for _ in range(3):
    weights, opt_state, loss = jitted(*args)
    args = (weights, opt_state, args[2])
    losses.append(float(loss))
  assert calls == [((2, 3, 4), 4, 4, TINY["layers"],
                    jax.lax.Precision.HIGH)] * 2  # traced once
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_jax_refuses_bf16_for_its_cudnn_lstm():
  with pytest.raises(NotImplementedError, match="bfloat16"):
    cudnn_jax.runner(TINY, 2, "bf16", jnp.bfloat16)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="a CPU row")
def test_jax_cudnn_rows_are_error_rows_off_cuda():
  cands = [c for c in gpu_kernel.candidates(TINY, "float32", 2)
           if c[0].startswith("jax_cudnn")]
  rows = gpu_kernel.time_group(TINY, "float32", 2, cands, rounds=1)
  assert [r["name"] for r in rows] == [
      "jax_cudnn_fp32_S1", "jax_cudnn_tf32_S1", "jax_cudnn_fp32_loop_S2",
      "jax_cudnn_tf32_loop_S2"]
  for r in rows:
    assert "tokens_per_s" not in r and "\n" not in r["error"]
    assert r["error"] == ("RuntimeError: jax.experimental.rnn.lstm lowers "
                          "for CUDA and ROCm only: no cpu lowering")
  (bf16,) = [r for r in gpu_kernel.time_group(
      TINY, "bfloat16", 1, [c for c in gpu_kernel.candidates(
          TINY, "bfloat16", 1) if c[0] == "jax_cudnn_bf16"], rounds=1)]
  assert bf16["error"] == ("NotImplementedError: bfloat16 support not "
                           "implemented for LSTM")


def test_flashrnn_row_says_why_it_cannot_run(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "flashrnn", None)
  monkeypatch.setattr(flashrnn_rows.importlib.util, "find_spec",
                      lambda name: None)
  why = flashrnn_rows.missing()
  assert why.startswith("flashrnn not installed")
  (row,) = gpu_kernel.time_group(
      TINY, "bfloat16", 2, [("flashrnn_triton", gpu_kernel.flashrnn_builder(
          TINY, 2, "bf16", "triton"))], rounds=1)
  assert row == {"name": "flashrnn_triton_S2", "impl": "flashrnn_triton",
                 "stripes": 2, "group": 2, "grouped": True,
                 "dtype": "bfloat16", "error": why}


def test_flashrnn_triton_rows_past_its_head_size_say_so_unbuilt():
  """Heads wider than FlashRNN's Triton kernels take: a row that says so
  at once, never a build; its CUDA backend is built for them."""
  shape = {**TINY, "hidden": 1024}
  why = gpu_kernel.flashrnn_builder(shape, 8, "bf16", "triton")
  assert why == ("FlashRNN's Triton kernels take heads of at most 64 units:"
                 " 128 here")
  assert flashrnn_rows.unsupported(1024, 16, "triton") == ""
  assert flashrnn_rows.unsupported(1024, 1, "cuda") == ""


def test_flashrnn_device_query_reads_torchs_properties():
  """The four figures FlashRNN's CUDA kernels read, from torch's device
  properties (an H100's here); a field torch lacks takes the value every
  GPU since compute capability 5.0 has."""
  h100 = types.SimpleNamespace(multi_processor_count=132,
                               shared_memory_per_block_optin=232448,
                               regs_per_multiprocessor=65536)
  assert flashrnn_rows.device_query(h100) == {
      "maxThreadsPerBlock": 1024, "regsPerMultiprocessor": 65536,
      "multiProcessorCount": 132, "sharedMemPerBlockOptin": 232448}
  small = types.SimpleNamespace(multi_processor_count=2,
                                shared_memory_per_block_optin=1024,
                                regs_per_multiprocessor=32768,
                                max_threads_per_block=512)
  assert flashrnn_rows.device_query(small) == {
      "maxThreadsPerBlock": 512, "regsPerMultiprocessor": 32768,
      "multiProcessorCount": 2, "sharedMemPerBlockOptin": 1024}


def test_flashrnn_installed_without_cuda_says_so(tmp_path, monkeypatch):
  """A flashrnn package that imports (a stand-in on the path), torch
  without a CUDA device: the reason names CUDA."""
  torch = pytest.importorskip("torch")
  (tmp_path / "flashrnn").mkdir()
  (tmp_path / "flashrnn" / "__init__.py").write_text("")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
  assert flashrnn_rows.missing() == ("flashrnn runs on CUDA only: torch "
                                     "sees no CUDA device")


def test_a_baseline_that_raises_is_an_error_row(monkeypatch):
  """A candidate that raises at its first call: its first error line; the
  others are timed and the ratios only count rows that ran."""
  ptxas = ("Triton compilation failed\nptxas line 4; error   : too much "
           "shared data\nfatal")

  def fail():
    def step():
      raise RuntimeError(ptxas)
    return step
  calls = []
  cands = [("zebra_scan", lambda: lambda: calls.append(1)),
           ("torch_cudnn_bf16", fail),
           ("flashrnn_triton", "flashrnn not installed: why"),
           ("jax_cudnn_tf32", lambda: lambda: None)]
  monkeypatch.setattr(gpu_kernel, "ROUND_S", 0.0)  # one step a round
  rows = gpu_kernel.time_group(TINY, "bfloat16", 8, cands, rounds=3)
  assert [r["name"] for r in rows] == [
      "zebra_scan_S8", "torch_cudnn_bf16_S8", "flashrnn_triton_S8",
      "jax_cudnn_tf32_S8"]
  assert len(calls) == 1 + 1 + 1 + 3  # built, calibrated, untimed, rounds
  assert rows[1]["error"] == ("RuntimeError: ptxas line 4; error   : too "
                              "much shared data")
  assert rows[2]["error"] == "flashrnn not installed: why"
  ratios = gpu_kernel.ratios(rows)
  assert list(ratios) == ["zebra_scan_S8"]
  assert list(ratios["zebra_scan_S8"]) == ["jax_cudnn_tf32_S8"]
  assert all(r["group"] == 8 for r in rows)


def test_a_short_step_is_timed_over_several_calls_a_round(monkeypatch):
  """A 10 ms step in rounds of 50 ms: several calls a round, and the row
  is the time of one step, not of a round."""
  monkeypatch.setattr(gpu_kernel, "ROUND_S", 0.05)
  calls = []

  def build():
    def step():
      calls.append(1)
      time.sleep(0.01)
    return step
  (row,) = gpu_kernel.time_group(TINY, "float32", 1, [("zebra_scan", build)],
                                 rounds=2)
  per_round = (len(calls) - 2) // 3  # built, calibrated; untimed + 2 rounds
  assert 2 <= per_round <= 5
  assert len(calls) == 2 + 3 * per_round
  assert 10.0 <= row["ms_per_step"] < 20.0


def test_a_build_past_the_deadline_is_left_behind():
  """A build still running at the deadline: its row says so at once, the
  next build is not started, and the thread is reported left behind."""
  started = []

  def slow():
    started.append(1)
    time.sleep(3)
    return lambda: None
  start = time.monotonic()
  rows = gpu_kernel.time_group(
      TINY, "bfloat16", 2, [("flashrnn_triton", slow)], rounds=1,
      deadline=time.time() + 0.3)
  assert time.monotonic() - start < 2
  assert rows[0]["error"].startswith("still building after 0 s")
  assert gpu_kernel.left_behind()
  (row,) = gpu_kernel.time_group(
      TINY, "bfloat16", 2, [("flashrnn_cuda", slow)], rounds=1,
      deadline=time.time() - 1)
  assert row["error"] == "not built: the stage's budget was spent"
  assert started == [1]


def test_ratios_are_ours_over_each_baseline_of_its_group():
  """Within a group (timed in one process, interleaved): a dense baseline
  timed in the S=8 group counts for the S=8 rows, never the S=1 group's."""
  row = lambda impl, s, group, tok: {"name": f"{impl}_S{s}", "impl": impl,
                                     "stripes": s, "group": group,
                                     "tokens_per_s": tok}
  rows = [row("zebra_scan", 1, 1, 100.0), row("torch_cudnn_bf16", 1, 1, 50.0),
          row("zebra_pallas", 8, 8, 300.0), row("torch_cudnn_bf16", 1, 8,
                                                  60.0),
          row("torch_cudnn_bf16_loop", 8, 8, 30.0),
          row("flashrnn_triton", 8, 8, 200.0)]
  assert gpu_kernel.ratios(rows) == {
      "zebra_scan_S1": {"torch_cudnn_bf16_S1": 2.0},
      "zebra_pallas_S8": {"torch_cudnn_bf16_S1": 5.0,
                          "torch_cudnn_bf16_loop_S8": 10.0,
                          "flashrnn_triton_S8": 1.5}}


def test_an_s8_group_times_dense_baselines_beside_its_loops():
  """At S > 1 every cuDNN baseline runs twice: one dense LSTM of width H
  (the same function, named _S1) and the per-stripe loop (_loop_S8)."""
  shape = dict(TINY, hidden=32)
  names = [(c[0], c[2]) for c in gpu_kernel.candidates(shape, "float32", 8)]
  assert names == [("zebra_scan", 8), ("zebra_pallas", 8),
                   ("jax_cudnn_fp32", 1), ("jax_cudnn_tf32", 1),
                   ("torch_cudnn_fp32", 1), ("torch_cudnn_tf32", 1),
                   ("jax_cudnn_fp32_loop", 8), ("jax_cudnn_tf32_loop", 8),
                   ("torch_cudnn_fp32_loop", 8), ("torch_cudnn_tf32_loop", 8),
                   ("flashrnn_triton", 8)]
  assert [gpu_results.baseline_kind(n) for n, _ in names[2:]] == (
      ["same function"] * 4 + ["per-stripe loop"] * 4 + ["FlashRNN"])
  assert [gpu_kernel.math_of(n, "float32") for n, _ in names] == [
      "tf32", "tf32", "fp32", "tf32", "fp32", "tf32", "fp32", "tf32", "fp32",
      "tf32", "fp32"]
  # the loop computes what the grouped stripes compute; the dense LSTM S x
  # the recurrence and the input projection
  assert gpu_kernel.row_flops(shape, "torch_cudnn_fp32_loop", 8) == (
      gpu_kernel.row_flops(shape, "zebra_scan", 8))
  assert gpu_kernel.row_flops(shape, "torch_cudnn_fp32", 1) == (
      8 * gpu_kernel.row_flops(shape, "zebra_scan", 8))


def test_a_step_that_fails_while_timed_is_an_error_row():
  """A step that runs once, then raises: the others keep their times."""
  calls = []

  def flaky():
    def step():
      calls.append(1)
      if len(calls) > 2:
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory")
    return step
  rows = gpu_kernel.time_group(
      TINY, "float32", 1, [("zebra_scan", lambda: lambda: None),
                           ("torch_cudnn_fp32", flaky)], rounds=3)
  assert rows[0]["tokens_per_s"] > 0
  assert rows[1]["error"] == ("MemoryError: RESOURCE_EXHAUSTED: out of "
                              "memory")
