"""What several test modules share: the repository's root, small corpora and
configs, train steps across device counts, checkpoint damage, a stand-in for
Triton's Python backend, a live zebra_jax server, the abstract GPU Pallas
kernels lower for, a Pallas layer's gradient to lower, and a fake LM whose
text the serving engine's tests can follow. Session fixtures live in
conftest.py; the NumPy model references in references.py."""

import contextlib
import glob
import http.client
import json
import importlib
import importlib.util
import inspect
import logging
import os
import re
import shutil
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from zebra_jax import engine
from zebra_jax.configs import demo, wt103
from zebra_jax.inference import triton_local
from zebra_jax.model import cpu_bf16_head
from zebra_jax.serving import serve
from zebra_jax.model.recurrence import native as native_recurrence
from zebra_jax.model.recurrence import native_build, native_check
from zebra_jax.model.recurrence import scan as scan_recurrence
from zebra_jax.runtime import parallel
from zebra_jax.training import loop, train_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the cat sat on a mat while the dog ran to the park and the bird sang "
         "in a tree near the old house by the river").split()


def write_wikitext(folder, seed=0):
  """A WikiText-format folder of simple, learnable sentences."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  for split, lines in (("train", 400), ("valid", 60), ("test", 60)):
    with open(os.path.join(folder, f"wiki.{split}.tokens"), "w") as f:
      for _ in range(lines):
        start = rng.integers(0, len(WORDS) - 8)
        f.write(" " + " ".join(WORDS[start:start + 8]) + " . \n")
  return folder


def tiny_word_config(data_dir, head=None):
  """wt103.py:tiny (the adaptive head) on `data_dir`. head="full" is for tests
  of mechanics the head does not touch: its compiles take half the time."""
  cfg = wt103.get_config("tiny")
  cfg.data.path = str(data_dir)
  if head is not None:
    cfg.model.head = head
  return cfg


# ------------------------------------------------- train steps, device counts


def tiny_sgd_config(**model):
  """wt103.py:tiny without dropout, on SGD with momentum and no warm-up: the
  config the train-step comparisons across device counts run."""
  cfg = wt103.get_config("tiny")
  cfg.model.vocab_size = 29
  cfg.model.update(dropout_hidden=0.0, dropout_output=0.0, **model)
  cfg.optim.update(name="sgd", momentum=0.9, learning_rate=0.5, warmup_steps=0)
  cfg.train.num_steps = 100
  cfg.data.batch_size = 16
  return cfg


def random_batches(cfg, n, seed=0):
  """`n` batches of random ids, the carry reset on the first."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.model.vocab_size,
                     (n, cfg.data.batch_size, cfg.data.seq_len + 1))
  return [{"inputs": b[:, :-1].astype(np.int32),
           "targets": b[:, 1:].astype(np.int32),
           "reset": np.asarray(i == 0)} for i, b in enumerate(ids)]


def run_train_steps(cfg, num_devices, batches, accum=1, state=None):
  """The compiled train step over `batches` on the first `num_devices`
  devices: (the final state on the host, each step's metrics)."""
  mesh = parallel.make_mesh(jax.devices()[:num_devices])
  graphdef, tx, fresh = train_state.init_state(cfg, mesh)
  state = fresh if state is None else state
  step = loop.compile_train_step(graphdef, tx, mesh, state, accum)
  metrics = []
  for b in batches:
    batch = {k: (parallel.global_batch(mesh, v) if v.ndim else v)
             for k, v in b.items()}
    state, m = step(state, batch)
    metrics.append(jax.device_get(m))
  return jax.device_get(state), metrics


def stripe_config(stripe_input="dense", stripe_devices=1, **model):
  """2 layers x hidden 32 in 8 stripes, window 4, batch 8, SGD, no dropout:
  the stripe-parallel step the compiled-program checks read."""
  cfg = demo.get_config("tiny")
  model = {"dropout_hidden": 0.0, "dropout_output": 0.0, **model}
  cfg.model.update(vocab_size=29, embed_size=32, hidden_size=32, num_layers=2,
                   num_stripes=8, stripe_input=stripe_input, **model)
  cfg.data.update(batch_size=8, seq_len=4)
  cfg.optim.update(name="sgd", momentum=0.9, learning_rate=0.5,
                   warmup_steps=0)
  cfg.parallel.stripe_devices = stripe_devices
  return cfg


def stripe_mesh(data, stripe):
  return parallel.make_mesh(jax.devices()[:data * stripe],
                            stripe_devices=stripe)


def compiled_train_step(cfg, data, stripe, accum=1):
  """The train step compiled on a `data x stripe` mesh, for one batch."""
  mesh = stripe_mesh(data, stripe)
  graphdef, tx, state = train_state.init_state(cfg, mesh)
  step = loop.compile_train_step(graphdef, tx, mesh, state, accum)
  b = random_batches(cfg, 1)[0]
  batch = {k: parallel.global_batch(mesh, v) if v.ndim else v
           for k, v in b.items()}
  return step.lower(state, batch).compile()


def assert_trees_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


# ------------------------------------------------------- checkpoint damage


def array_files(workdir, step):
  """The array data files of checkpoint `step` in `workdir`."""
  return glob.glob(f"{workdir}/checkpoints/{step}/state/**/d/*", recursive=True)


def flip_a_bit_orbax_reads(workdir, step, target, process=None):
  """Flips one bit inside an array data file of a step where orbax restores
  without complaint but some value changes: what only a checksum can catch.

  Returns the path and offset. Orbax stores arrays as zstd frames without
  content checksums: a flip in a block's raw literals (float bytes that do
  not compress, right after the block's few header bytes) decodes without
  complaint, one later in a block mostly breaks decoding. So offsets are
  tried from just past the frame header on.
  """
  files = array_files(workdir, step)
  if process is not None:
    files = [f for f in files if f"ocdbt.process_{process}/" in f]
  path = max(files, key=os.path.getsize)
  original = open(path, "rb").read()
  raw = ocp.CheckpointManager(f"{workdir}/checkpoints", item_names=("state",))
  args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
  clean = jax.device_get(raw.restore(step, args=args).state)
  for offset in range(16, len(original), 37):
    damaged = bytearray(original)
    damaged[offset] ^= 0x10
    with open(path, "r+b") as f:
      f.write(damaged)
    try:
      read = jax.device_get(ocp.CheckpointManager(
          f"{workdir}/checkpoints", item_names=("state",)).restore(
              step, args=args).state)
    except Exception:  # orbax noticed: not the damage this is about
      continue
    if any(not np.array_equal(a, b) for a, b in
           zip(jax.tree.leaves(clean), jax.tree.leaves(read))):
      return path, offset
  with open(path, "r+b") as f:
    f.write(original)
  raise AssertionError(f"no bit in {path} changes data that orbax reads back")


# ------------------------------------------ Triton's Python backend, faked


class _Tensor:
  """Stand-in for pb_utils.Tensor: a name and a numpy array."""

  def __init__(self, name, array):
    self.name, self._array = name, np.asarray(array)

  def as_numpy(self):
    return self._array


class _Response:
  def __init__(self, output_tensors, error=None):
    self.output_tensors, self.error = output_tensors, error


def _fake_pb_utils():
  pb = types.ModuleType("triton_python_backend_utils")
  pb.Tensor, pb.InferenceResponse = _Tensor, _Response
  pb.TritonError = lambda message: message
  pb.get_input_tensor_by_name = lambda request, name: request.get(name)
  return pb


def load_triton_model(model_dir, monkeypatch):
  """The exported Triton model.py, initialised, with a stand-in for Triton's
  triton_python_backend_utils."""
  monkeypatch.setitem(sys.modules, "triton_python_backend_utils",
                      _fake_pb_utils())
  spec = importlib.util.spec_from_file_location(
      "triton_zebra_model", os.path.join(model_dir, "1", "model.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  triton_model = module.TritonPythonModel()
  triton_model.initialize({"model_repository": model_dir, "model_version": "1",
                           "model_instance_kind": "CPU",
                           "model_instance_device_id": "0"})
  return triton_model


def triton_request(prompts, **fields):
  """A stand-in Triton request: the tensors triton_local.arrays() builds
  (one UTF-8 PROMPT row per prompt, and fields such as MAX_NEW_TOKENS=10)."""
  return {name: _Tensor(name, array) for name, array in
          triton_local.arrays(prompts, **fields).items()}


def write_metrics_run(workdir, ms_per_batch, final_loss, start=1_000_000.0):
  """A synthetic metrics.jsonl in the format training writes, a torn last
  line included."""
  os.makedirs(workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(10, 101, 10):
      loss = final_loss + 2.0 / step
      t = start + step * ms_per_batch / 1000
      f.write(json.dumps({"kind": "train", "step": step, "time": t,
                          "ms_per_batch": ms_per_batch, "tok_per_s": 1e4,
                          "loss": loss, "ppl": 2.718 ** loss, "acc": 0.5})
              + "\n")
      if step % 50 == 0:
        f.write(json.dumps({"kind": "valid", "step": step, "time": t + 1,
                            "loss": loss + 0.1, "ppl": 2.718 ** (loss + 0.1),
                            "acc": 0.5}) + "\n")
    f.write('{"kind": "train", "step": 1')  # a torn last line (killed run)


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
  """A PNG with axes, curves and a legend, not a blank."""
  with open(path, "rb") as f:
    assert f.read(8) == _PNG_MAGIC
  assert os.path.getsize(path) > 5000  # axes, curves and legend, not a blank


@contextlib.contextmanager
def live_server(service, api_key="", **options):
  """A zebra_jax server for `service` on a free loopback port, in a thread:
  yields the Server (its .server_port); stopped and closed on exit."""
  httpd = serve.make_server(service, "127.0.0.1", 0, api_key, **options)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  try:
    yield httpd
  finally:
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=30)


def http_call(port, method, path, body=None, headers=None):
  """(status, headers, raw answer) of a request to 127.0.0.1; body: bytes,
  or anything json.dumps takes."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
  try:
    data = None if body is None else (
        body if isinstance(body, bytes) else json.dumps(body).encode())
    sent = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, path, body=data, headers={**sent, **(headers or {})})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()
  finally:
    conn.close()


# ------------------------------------ a fake LM for the serving engine


class Letters:
  """a-z as tokens 0-25."""
  spaces_in_tokens = True

  def encode_prompt(self, text):
    return [ord(c) - 97 for c in text]

  def decode(self, ids):
    return "".join(chr(97 + int(i)) for i in ids)


def counter_model():
  """A fake LM whose next token is a hash of every token consumed:
  h <- (3h + token + 1) mod 26, next token = h. Any step taken on a row's
  state that is not its own token changes its text."""
  def step_fn(params, carry, tokens):
    (h,) = carry
    h = (3 * h + tokens[:, None].astype(h.dtype) + 1) % 26
    logits = params["scale"] * jax.nn.one_hot(h[:, 0].astype(int), 26)
    return logits, (h,)

  return engine.Model(
      step_fn=step_fn, params={"scale": np.float32(10)},
      init_carry=lambda b: (jax.numpy.zeros((b, 1), jax.numpy.float32),),
      vocab_size=26, tokenizer=Letters())


def counter_text(prompt, n):
  """counter_model's greedy text of n tokens after `prompt`, worked out
  without the engine."""
  h, out = 0, []
  for c in prompt:
    h = (3 * h + ord(c) - 97 + 1) % 26
  for _ in range(n):
    out.append(h)
    h = (3 * h + h + 1) % 26
  return "".join(chr(97 + t) for t in out)


# The native layer's arguments (inputs, w_x, bias, h0, c0, w_h): S=1, T=2,
# B=3, G=4.
NATIVE_SHAPES = ((2, 3, 8), (8, 1, 16), (1, 16), (1, 3, 4), (1, 3, 4),
                 (1, 4, 16))


def native_layer_args():
  rng = np.random.default_rng(0)
  return [jax.numpy.asarray(0.3 * rng.standard_normal(s), np.float32)
          for s in NATIVE_SHAPES]


needs_compiler = pytest.mark.skipif(
    native_build.compiler() is None
    or shutil.which(native_build.compiler().split()[0]) is None,
    reason="no C++ compiler on this machine")


# Whether this CPU has the bf16 units the native bf16 products run on; the
# tests of those products run where it has (a failed build fails them).
HAS_BF16_UNITS = cpu_bf16_head.FEATURE in native_check.cpu_flags()
needs_bf16_units = pytest.mark.skipif(
    not HAS_BF16_UNITS, reason=f"this CPU has no {cpu_bf16_head.FEATURE}")
# The GPU report's precision stage: bf16 training's loss within 0.001 of
# float32's (max |difference| after warm-up), which the CPU's bf16 products
# are held to as well.
BF16_LOSS_TOLERANCE = 1e-3


def lm_loss_step(model_cfg, batch: int, steps: int):
  """(the jitted mean cross-entropy and its gradients, the parameters) of
  a fresh ZebraLM on fixed random tokens, [batch, steps + 1] of its
  vocabulary."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from zebra_jax.model import lm  # pylint: disable=g-import-not-at-top
  graphdef, params = nnx.split(lm.ZebraLM(model_cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (batch, steps + 1), 0,
                              model_cfg.vocab_size)
  carry = lm.init_carry(model_cfg, batch)

  def loss(p):
    logits, _ = lm.apply(graphdef, p, tokens[:, :-1], carry)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
  return jax.jit(jax.value_and_grad(loss)), params


def assert_same_bits(a, b):
  """Every leaf of two trees equal, bit for bit."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def fallback_lines(caplog):
  return [r.getMessage() for r in caplog.records
          if "running the scan instead" in r.getMessage()]


def runs_the_scan(caplog):
  """Calls the native layer twice: the scan's results, and the one warning
  line it logged."""
  args = native_layer_args()
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      got = native_recurrence.zebra_layer(*args, 1, False)
  want = scan_recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  lines = fallback_lines(caplog)
  assert len(lines) == 1, lines
  return lines[0]


def http_post(port, path, body):
  """(status, JSON answer) of a POST to a server on 127.0.0.1."""
  status, _, answer = http_call(port, "POST", path, body)
  return status, json.loads(answer)


def sampled_text(stdout: str) -> str:
  """--mode=sample's text: what follows its header line."""
  return stdout.split("-----\n", 1)[1].strip()


def score_numbers(stdout: str) -> list[float]:
  """The numbers of --mode=score's first line: tokens, loss, ppl, bits."""
  line = next(l for l in stdout.splitlines() if l.startswith("| text 1 |"))
  numbers = [float(w) for w in line.replace("|", " ").split()
             if w.replace(".", "").isdigit()]
  assert len(numbers) == 5, line  # the text's number first
  return numbers[1:]


def triton_target():
  """jax >= 0.11 lowers Triton kernels without a GPU only for a named
  abstract GPU; jax 0.10 lowers for a default one."""
  mesh_params = inspect.signature(jax.sharding.AbstractMesh).parameters
  if "abstract_device" not in mesh_params:
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100",
                                       num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=device))


def pallas_layer_grad(s, t, b, g, n_in, dtype, remat=False, kernel="pallas"):
  """(value_and_grad of a sum over a Pallas layer's outputs, the shapes of
  its six inputs): both kernels, forward and backward, for lowering. The
  matmul operands are `dtype`; biases and the carry float32. kernel: the
  module in zebra_jax/model/recurrence/ (pallas, pallas_stream)."""
  pallas = importlib.import_module(f"zebra_jax.model.recurrence.{kernel}")
  f32, sds = jnp.float32, jax.ShapeDtypeStruct
  specs = (sds((t, b, n_in), dtype), sds((n_in, s, 4 * g), dtype),
           sds((s, 4 * g), f32), sds((s, b, g), f32), sds((s, b, g), f32),
           sds((s, g, 4 * g), dtype))

  def loss(*a):
    ys, h, c = pallas.zebra_layer(*a, 1, remat, interpret=False)
    return jnp.sum(ys.astype(f32)) + jnp.sum(h) + jnp.sum(c)

  return jax.value_and_grad(loss, argnums=tuple(range(6))), specs


def python_block(page: str, contains: str) -> str:
  """The ```python block of a docs page (path from the repository root)
  that holds `contains`: the tests run the pages' examples as written."""
  with open(os.path.join(REPO, page), encoding="utf-8") as f:
    blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)
  [block] = [b for b in blocks if contains in b]
  return block


# ------------------------------------ the Pallas kernels against the scan

LAYER_STEPS, LAYER_INPUTS = 3, 8  # window and layer input of the kernels' tests


def normal_array(rng, shape, scale=1.0):
  """float32 draws of scale x a standard normal."""
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def stripe_layer_args(stripes, kind, dtype, seed=0, batch=4, width=4):
  """Layer arguments as ZebraLSTMLayer passes them to the recurrence
  (zebra_jax/model/recurrence/scan.py): a window of LAYER_STEPS steps of
  LAYER_INPUTS inputs, dense or grouped.

  NumPy draws them: jax.random would compile a kernel per shape. U_s scales
  as 1/sqrt(G), so gates stay off saturation at every width."""
  rng = np.random.default_rng(seed)
  s, g, t, n_in = stripes, width, LAYER_STEPS, LAYER_INPUTS
  if kind == "dense":
    inputs = normal_array(rng, (t, batch, n_in))
    w_x = normal_array(rng, (n_in, s, 4 * g), 0.4)
  else:  # grouped: stripe s reads its own n_in/S inputs
    inputs = normal_array(rng, (s, t, batch, n_in // s))
    w_x = normal_array(rng, (s, n_in // s, 4 * g), 0.4)
  bias = normal_array(rng, (s, 4 * g), 0.2)
  h0 = normal_array(rng, (s, batch, g), 0.5)
  c0 = normal_array(rng, (s, batch, g), 0.5)
  w_h = normal_array(rng, (s, g, 4 * g), 0.8 / np.sqrt(g))
  return (jnp.asarray(inputs, dtype), jnp.asarray(w_x, dtype),
          jnp.asarray(bias), jnp.asarray(h0), jnp.asarray(c0),
          jnp.asarray(w_h, dtype))


def value_and_grads(layer_fn, args, cotangents):
  """(ys, h, c) and the gradients of every argument for the given
  cotangents of ys, h and c."""
  outs, vjp = jax.vjp(layer_fn, *args)
  return outs, vjp(tuple(ct.astype(o.dtype)
                         for ct, o in zip(cotangents, outs)))


def layer_cotangents(args):
  """Fixed random weights for ys [S, T, B, G], h and c [S, B, G]: no
  gradient path is zero or symmetric."""
  s, b, g = args[3].shape
  t = args[0].shape[-3]  # inputs: dense [T, B, I], grouped [S, T, B, I/S]
  rng = np.random.default_rng(7)
  return tuple(jnp.asarray(normal_array(rng, shape)) for shape in
               ((s, t, b, g), (s, b, g), (s, b, g)))


# A Pallas kernel against the scan: max |error| / max(1, max |reference|) per
# array, as measured over tests/model/test_pallas.py's cases. float32 runs: <= 6.0e-7 (the kernel's
# arithmetic is the scan's; a dot split in blocks sums in another order).
# bfloat16 runs: <= 5.9e-6 on float32 arrays (d_h0) and <= 4.9e-5 on
# bfloat16 arrays (d_w_h) beyond one bfloat16 rounding step (2**-8 relative,
# where a float32 value straddles a rounding boundary): a float32 difference
# in the last bit flips a bfloat16 operand (dz, h) that later sums carry.
# Tolerances are 5x those.
SCALED_ATOL = {jnp.dtype(jnp.float32): 3e-6, jnp.dtype(jnp.bfloat16): 2.5e-4}


def check_against_scan(layer_fn, args, remat=False):
  """A layer function's outputs, final carry and gradients against the
  scan's, within SCALED_ATOL; returns both results."""
  cts = layer_cotangents(args)
  got = jax.jit(lambda a, c: value_and_grads(layer_fn, a, c))(args, cts)
  want = jax.jit(lambda a, c: value_and_grads(
      lambda *x: scan_recurrence.zebra_layer(*x, 1, remat), a, c))(args, cts)
  names = ["ys", "h", "c", "d_inputs", "d_w_x", "d_bias", "d_h0", "d_c0",
           "d_w_h"]
  scaled_atol = SCALED_ATOL[jnp.dtype(args[-1].dtype)]
  for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    rtol = 2.0**-8 if g.dtype == jnp.bfloat16 else 0.0
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    atol = scaled_atol * max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)
  return got, want


def check_runs_scan(layer_fn, args, caplog, why):
  """layer_fn, called twice, returns the scan's results exactly, and one
  warning line says why the scan runs."""
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      got = layer_fn(*args)
  want = scan_recurrence.zebra_layer(*args, 1, False)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  lines = [r.getMessage() for r in caplog.records
           if "running the scan instead" in r.getMessage()]
  assert len(lines) == 1 and why in lines[0]
  assert "\n" not in lines[0]
