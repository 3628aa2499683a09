"""Triton Python-backend model for a zebra_jax export (copied by --mode=export).

Needs numpy, jax (with jaxlib for the serving platform) and flatbuffers (jax
reads the serialized functions with it), plus the HF `tokenizers` package for
a BPE model: `requirements.txt` next to this file lists them. Also the
`artifact/` folder next to this file (two `jax.export` functions, the
weights, the tokenizer files) and `engine/`, zebra_jax's serving engine,
which imports jax and numpy only. No zebra_jax, Flax or config code runs here,
and that is deliberate: a Triton deployment copies the model repository into
the server's own Python environment, where installing the training package
(Flax, optax, orbax, absl, ml_collections, pinned to the trainer's versions)
would tie the serving image to the training code. The prompt-side tokenizers
below are therefore self-contained; the export checks that they decode
exactly as the package's own tokenizer does.

The artifact's `tokenizer.zebra.json` names the kind and, for char and word,
holds the vocabulary; BPE reads the HF `tokenizer.json` next to it.

Text travels as UTF-8 bytes in UINT8 tensors with a length per row
(PROMPT [batch, n] + PROMPT_LENGTH [batch, 1] in, TEXT + TEXT_LENGTH out),
not as BYTES (TYPE_STRING): the Python backend stub of Triton 2.51 mis-reads
BYTES inputs when the model's Python has numpy 2, which every supported jax
needs, while numeric tensors pass intact.

Generation goes through the serving engine (engine/, the one --mode=sample
and --mode=serve run), over the exported step function: every row of every
request Triton hands to one execute() call (the dynamic batcher merges
concurrent requests) joins the engine's running batch, whatever its
settings. Those are the engine's SamplingParams, every field of it: an
optional input per field (engine/wire.py names and decodes them; the
export declares them in config.pbtxt), and the manifest's default for an
input not sent, the defaults --mode=serve applies. They are per-row data,
so nothing recompiles, and row j of a request draws from its own stream of
the request's SEED (a fresh seed when none is sent), so its text does not
depend on what it was batched with and equals what zebra_jax generates for
the same settings. A field whose effect TEXT cannot carry (log-probabilities)
is refused, not ignored. BATCH_ROWS returns how many rows ran together.
"""

import importlib.util
import json
import os
import sys

try:
  import jax
except ImportError:
  # The Python backend's stub starts its interpreter without reading
  # PYTHONPATH: the launcher (triton_local.py) names a virtual environment's
  # packages here instead. A Triton image with jax installed never gets here.
  sys.path.extend(p for p in os.environ.get(
      "ZEBRA_JAX_TRITON_PATH", "").split(os.pathsep) if p)
  import jax
import numpy as np

try:
  import triton_python_backend_utils as pb_utils  # provided by Triton
except ImportError:  # importable outside Triton (Artifact is useful alone)
  pb_utils = None

UNK, EOS = "<unk>", "<eos>"
RECORD = "tokenizer.zebra.json"


def _load_engine():
  """The engine/ package: next to this file in an exported repository, or
  zebra_jax/engine in the sources this file lies in."""
  here = os.path.dirname(os.path.abspath(__file__))
  for path in (os.path.join(here, "engine"),
               os.path.join(here, os.pardir, os.pardir, "engine")):
    init = os.path.join(path, "__init__.py")
    if os.path.exists(init):
      name = "zebra_serving_engine"
      spec = importlib.util.spec_from_file_location(
          name, init, submodule_search_locations=[path])
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module  # its modules import each other by it
      spec.loader.exec_module(module)
      return module
  raise ImportError(f"engine/ is missing next to {__file__}: export again")


engines = _load_engine()


class _VocabTokenizer:
  """An id -> token list from the record (char and word)."""

  def __init__(self, folder: str, record: dict):
    del folder  # the record holds the vocabulary
    self.vocab = record["vocab"]
    self.ids = {t: i for i, t in enumerate(self.vocab)}
    self.unk = self.ids[UNK]


class CharTokenizer(_VocabTokenizer):
  """Every character is a token; unseen ones read as `<unk>`."""

  spaces_in_tokens = True

  def encode_prompt(self, text: str) -> list[int]:
    return [self.ids.get(c, self.unk) for c in text]

  def decode(self, ids) -> str:
    return "".join("\ufffd" if self.vocab[i] == UNK else self.vocab[i]
                   for i in ids)


class WordTokenizer(_VocabTokenizer):
  """Whitespace words; `<eos>` ends every line but an open last one."""

  spaces_in_tokens = False

  def encode_prompt(self, text: str) -> list[int]:
    ids = []
    for line in text.split("\n"):
      ids += [self.ids.get(w, self.unk) for w in line.split()]
      ids.append(self.ids[EOS])
    return ids[:-1]

  def decode(self, ids) -> str:
    out, line_start = [], True
    for i in ids:
      if self.vocab[i] == EOS:
        out.append("\n")
        line_start = True
        continue
      out.append(self.vocab[i] if line_start else " " + self.vocab[i])
      line_start = False
    return "".join(out)


class BPETokenizer:
  """Byte-level BPE from the HF `tokenizer.json` (needs `tokenizers`)."""

  spaces_in_tokens = True  # " world" is one token

  def __init__(self, folder: str, record: dict):
    del record
    import tokenizers  # pylint: disable=g-import-not-at-top
    self._tok = tokenizers.Tokenizer.from_file(
        os.path.join(folder, "tokenizer.json"))

  def encode_prompt(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


TOKENIZERS = {"char": CharTokenizer, "word": WordTokenizer,
              "bpe": BPETokenizer}


def load_tokenizer(folder: str):
  """The tokenizer the record in `folder` names."""
  with open(os.path.join(folder, RECORD), encoding="utf-8") as f:
    record = json.load(f)
  if record.get("kind") not in TOKENIZERS:
    raise ValueError(f"{RECORD} names tokenizer {record.get('kind')!r}; this "
                     f"model serves {', '.join(TOKENIZERS)}")
  return TOKENIZERS[record["kind"]](folder, record)


class Artifact:
  """The exported model: prompt/step functions, weights, tokenizer."""

  # SamplingParams fields whose results the outputs (text) cannot carry.
  TEXT_ONLY = ("logprobs", "prompt_logprobs")

  def __init__(self, folder: str, device=None):
    def read(name, mode="r"):
      with open(os.path.join(folder, name), mode) as f:
        return f.read()

    self.manifest = json.loads(read("manifest.json"))
    # Every field's default; ValueError for an export of another version.
    self.defaults = engines.wire.from_json(self.manifest["sample"])
    self.tokenizer = load_tokenizer(folder)
    prompt = jax.export.deserialize(bytearray(read("prompt.jax", "rb")))
    step = jax.export.deserialize(bytearray(read("step.jax", "rb")))
    device = device or jax.devices()[0]
    with np.load(os.path.join(folder, "params.npz")) as npz:
      self.params = [jax.device_put(npz[f"leaf_{i:05d}"], device)
                     for i in range(self.manifest["num_params"])]
    self.device = device
    self._prompt, self._step = jax.jit(prompt.call), jax.jit(step.call)
    self._step_exported, self._engine = step, None

  def init_carry(self, batch: int):
    zeros = lambda: jax.device_put(np.zeros(
        (batch, self.manifest["hidden_size"]), np.float32), self.device)
    return tuple((zeros(), zeros()) for _ in range(self.manifest["num_layers"]))

  def prompt_logits(self, rows: list[list[int]]):
    """(last logits float32 [n, V], carry) with each row consumed exactly."""
    order, parts = [], []
    for length in sorted({len(r) for r in rows}):
      members = [i for i, r in enumerate(rows) if len(r) == length]
      tokens = np.asarray([rows[i] for i in members], np.int32)   # [n, T]
      parts.append(self._prompt(self.params, self.init_carry(len(members)),
                                tokens))
      order += members
    inverse = np.argsort(order)
    return jax.tree.map(lambda *xs: np.concatenate(xs)[inverse], *parts)

  def step(self, carry, tokens):
    """tokens int32 [b] -> (logits [b, V], carry)."""
    return self._step(self.params, carry, np.asarray(tokens, np.int32))

  def engine(self, **options):
    """The serving engine over the exported step function (built once;
    options as engine.Engine's: slots, queue, prefill_chunk, ...)."""
    if self._engine is None:
      exported = self._step_exported
      hidden, layers = self.manifest["hidden_size"], self.manifest["num_layers"]

      def init_carry(batch):
        zeros = lambda: jax.numpy.zeros((batch, hidden), np.float32)
        return tuple((zeros(), zeros()) for _ in range(layers))

      model = engines.Model(
          step_fn=lambda params, carry, tokens: exported.call(params, carry,
                                                              tokens),
          params=self.params, init_carry=init_carry,
          vocab_size=int(self.manifest["vocab_size"]),
          tokenizer=self.tokenizer)
      options = {**self.manifest.get("engine", {}), **options}
      self._engine = engines.Engine(model, **options)
    return self._engine

  def sampling_params(self, **values):
    """The manifest's defaults overridden by `values` (SamplingParams
    fields); ValueError naming the input of a value out of bounds or of a
    field this model cannot honour."""
    params = engines.SamplingParams(**{**self.defaults, **values})
    try:
      params.check(int(self.manifest["vocab_size"]))
    except engines.ParamError as e:
      raise ValueError(f"{e.field.upper()}: {e.reason}") from None
    for name in self.TEXT_ONLY:
      if getattr(params, name) is not None:
        raise ValueError(f"{name.upper()}: the Triton model returns text "
                         "only; drop it, or ask --mode=serve's OpenAI "
                         "routes for log-probabilities")
    return params

  def submit(self, prompts: list[str], params):
    """A request's rows into the engine, all or none; row j draws from
    stream j of the seed. Their Requests (.result() is the text after the
    prompt)."""
    if not prompts or any(not p for p in prompts):
      raise ValueError("every PROMPT must be a non-empty string")
    return self.engine().submit_many(
        [engines.Row(p, params, sample_index=j) for j, p in
         enumerate(prompts)], block=True)

  def generate(self, prompts: list[str], **values) -> list[str]:
    """prompt + continuation for every prompt, with the manifest's sampling
    defaults overridden by `values`; row j draws from stream j of the
    seed."""
    rows = self.submit(prompts, self.sampling_params(**values))
    return [p + r.result() for p, r in zip(prompts, rows)]

  def close(self) -> None:
    if self._engine is not None:
      self._engine.close()
      self._engine = None


def encode_texts(texts: list[str]):
  """UTF-8 rows, zero-padded: (uint8 [n, longest], int32 lengths [n, 1])."""
  raw = [t.encode("utf-8") for t in texts]
  out = np.zeros((len(raw), max([len(r) for r in raw] + [1])), np.uint8)
  for i, r in enumerate(raw):
    out[i, :len(r)] = np.frombuffer(r, np.uint8)
  return out, np.array([[len(r)] for r in raw], np.int32)


def decode_texts(data, lengths) -> list[str]:
  """The inverse of encode_texts; ValueError for a bad length or UTF-8."""
  data = np.asarray(data)
  lengths = np.asarray(lengths).reshape(-1)
  if data.ndim != 2 or data.dtype != np.uint8 or len(lengths) != len(data):
    raise ValueError("PROMPT must be uint8 [batch, bytes] with one "
                     "PROMPT_LENGTH per row")
  texts = []
  for row, n in zip(data, lengths):
    if not 0 <= n <= row.shape[0]:
      raise ValueError(f"PROMPT_LENGTH {n} is outside [0, {row.shape[0]}]")
    try:
      texts.append(row[:n].tobytes().decode("utf-8"))
    except UnicodeDecodeError as e:
      raise ValueError(f"PROMPT is not UTF-8 ({e})") from None
  return texts


class _Capsule:
  """Hands a DLPack capsule to np.from_dlpack."""

  def __init__(self, capsule):
    self._capsule = capsule

  def __dlpack__(self, **kwargs):
    del kwargs
    return self._capsule

  def __dlpack_device__(self):
    return (1, 0)  # kDLCPU


def _numpy(tensor):
  """An input tensor as numpy, read through DLPack: the stub's as_numpy()
  builds arrays with numpy 1's struct layout, which numpy 2 misreads."""
  if hasattr(tensor, "to_dlpack"):
    return np.from_dlpack(_Capsule(tensor.to_dlpack())).copy()
  return tensor.as_numpy()


def _tensor(name, array):
  """An output tensor, handed over through DLPack: the stub's
  Tensor(name, numpy array) reads the array's item size from numpy 1's
  struct layout, so under numpy 2 it sends no data."""
  array = np.ascontiguousarray(array)
  if hasattr(pb_utils.Tensor, "from_dlpack"):
    return pb_utils.Tensor.from_dlpack(name, array)
  return pb_utils.Tensor(name, array)


class TritonPythonModel:
  """What Triton's Python backend calls: initialize, execute, finalize."""

  def initialize(self, args):
    # Before JAX's first device use: it would otherwise grab 75% of GPU
    # memory per instance.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    folder = os.path.join(args["model_repository"], args["model_version"],
                          "artifact")
    device = None
    if args.get("model_instance_kind") == "GPU":
      device = jax.devices("gpu")[int(args["model_instance_device_id"])]
    self.artifact = Artifact(folder, device)
    self.executions = self.requests = 0

  def _read(self, request):
    """(prompts, SamplingParams) of one request; ValueError if malformed."""
    tensor = lambda name: pb_utils.get_input_tensor_by_name(request, name)
    if tensor("PROMPT") is None or tensor("PROMPT_LENGTH") is None:
      raise ValueError("send PROMPT (uint8 UTF-8 bytes [batch, n]) and "
                       "PROMPT_LENGTH (int32 [batch, 1])")
    prompts = decode_texts(_numpy(tensor("PROMPT")),
                           _numpy(tensor("PROMPT_LENGTH")))
    params = self.artifact.sampling_params(**engines.wire.read(
        lambda name: None if tensor(name) is None else _numpy(tensor(name))))
    return prompts, params

  def execute(self, requests):
    """Every row of every request joins the engine's running batch at once,
    whatever its settings; a bad request fails alone."""
    responses = [None] * len(requests)
    running = []                              # (request index, prompts, rows)
    for i, request in enumerate(requests):
      try:
        prompts, params = self._read(request)
        running.append((i, prompts, self.artifact.submit(prompts, params)))
      except Exception as e:  # one bad request must not fail the batch
        responses[i] = self._error(e)
    together = sum(len(rows) for _, _, rows in running)
    for i, prompts, rows in running:
      try:
        texts = [p + r.result() for p, r in zip(prompts, rows)]
        responses[i] = self._response(texts, together)
      except Exception as e:  # pylint: disable=broad-except
        responses[i] = self._error(e)
    self.executions += 1
    self.requests += len(requests)
    return responses

  @staticmethod
  def _response(texts, rows):
    data, lengths = encode_texts(texts)
    batch_rows = np.full((len(texts), 1), rows, np.int32)
    return pb_utils.InferenceResponse(output_tensors=[
        _tensor("TEXT", data), _tensor("TEXT_LENGTH", lengths),
        _tensor("BATCH_ROWS", batch_rows)])

  @staticmethod
  def _error(e):
    return pb_utils.InferenceResponse(
        output_tensors=[], error=pb_utils.TritonError(str(e)))

  def finalize(self):
    self.artifact.close()
    self.artifact = None
