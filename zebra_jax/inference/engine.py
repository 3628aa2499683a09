"""A serving engine: concurrent requests share one running batch of slots.

An LSTM's whole per-sequence state is (h, c) per layer, the same few KB at
token 1 and token 10,000, so continuous batching is a fixed array of `slots`
rows on the device. A request takes a free slot at any step and frees it
when it finishes; every decode call advances every busy slot by
`decode_block` tokens. Per-request settings (temperature, top-k, top-p,
repetition penalty, seed) are per-row arrays, data to the compiled code,
never compile-time constants. Row r's token i is drawn with
`fold_in(key_r, i)`, key_r from the request's own seed, and a row's
arithmetic never mixes with other rows', so a request's text does not depend
on who else is in the batch. Stop strings and max tokens are checked on the
host, on the text, after each call; a row may compute a few tokens past its
end, which are dropped.

Prompts enter by chunked prefill: `prefill_rows` prompts x `prefill_chunk`
tokens per call, each row stepping the same one-token recurrence as decoding
with a per-row length mask, so a prompt of any length is consumed exactly
(no padding reaches the carry) by ceil(length / chunk) calls of ONE shape.
Length buckets would need a compiled program per bucket and pad or split
prompts anyway; the masked chunk needs one. The engine therefore compiles
exactly two programs (prefill, decode), both at start-up, whatever the
traffic: stats()["compiled_programs"] counts their traces (jit cache misses).
Every decode call computes all slots, busy or not: a program for fewer rows
rounds differently (on the CPU a logit's last bits differed between 8 and
64 rows), so a request's text would depend on how many ran beside it.
Measured on the tiny char model (hidden 32; 2 idle CPU cores): a decode call
of 4 tokens costs 0.22-0.25 ms greedy whether 1 slot is busy or 64,
0.44-0.47 ms when rows sample; a 16-token prefill chunk costs 0.19 ms for 8
rows and 0.20 ms for 16 (so `prefill_rows` is 16: the calls are overhead-
bound). Earlier, on the same cores under load average 11 (+-50% between
runs), through the engine alone (no HTTP), 32 new tokens after prompts of
5-60 characters: 1 client 2,300-4,000 tokens/s (p50 6-15 ms a request), 16
clients 25,000-28,000, 64 clients 49,000-60,000. `decode_block` 4 against 8:
8 gave up to 1.8x more at 64 clients but makes a joining or stopping row
wait up to 8 steps and streams in coarser pieces.

No zebra_jax import: `--mode=export` copies this file next to the Triton
model, which serves through it with the exported functions.
"""

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Settings:
  """One request's settings; each becomes its row's entry in an array."""
  max_new_tokens: int = 16
  temperature: float = 1.0          # 0 = greedy: the first argmax
  top_k: int = 0                    # keep the k most likely; 0 = off
  top_p: float = 1.0                # nucleus mass kept; 1 = off
  repetition_penalty: float = 1.0   # CTRL's; 1 = off
  seed: int = 0                     # any Python int, 64 bits used
  stop: tuple = ()                  # cut before the first of these strings
  sample_index: int = 0             # row j of an n-sample request: own key

  def check(self) -> None:
    """ValueError naming the first setting no request can honour."""
    # `not x >= 0` rather than `x < 0`, so that NaN is refused too.
    if not (isinstance(self.max_new_tokens, int)
            and self.max_new_tokens >= 1):
      raise ValueError(f"max_new_tokens={self.max_new_tokens} is not a "
                       "whole number >= 1: ask for at least one token")
    if not 0 <= self.temperature < float("inf"):
      raise ValueError(f"temperature={self.temperature} is not a number "
                       ">= 0: use 0 for greedy decoding or e.g. 0.8")
    if not (self.top_k >= 0 and float(self.top_k).is_integer()):
      raise ValueError(f"top_k={self.top_k} is not a whole number >= 0: use "
                       "0 to keep every token or e.g. 40")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} is outside (0, 1]: use 1.0 to "
                       "turn nucleus sampling off or e.g. 0.95")
    if not 0 < self.repetition_penalty < float("inf"):
      raise ValueError(f"repetition_penalty={self.repetition_penalty} is "
                       "not a positive number: use 1.0 to turn it off")
    if not all(isinstance(s, str) and s for s in self.stop):
      raise ValueError("stop strings must be non-empty strings")


class QueueFull(Exception):
  """Every slot is busy and `queue` requests already wait."""

  def __init__(self, message: str, retry_after: float):
    super().__init__(message)
    self.retry_after = retry_after


class BadPrompt(ValueError):
  """A prompt the engine cannot take: empty, no tokens, or too long."""


@dataclasses.dataclass
class Model:
  """What the engine runs; nothing else about the model is needed.

  step_fn: pure `(params, carry, tokens int32 [b]) -> (logits [b, V],
    carry)`, traceable inside jit at any batch b.
  init_carry: `batch -> carry` of zeros (traceable).
  tokenizer: `encode_prompt(str) -> ids`, `decode(ids) -> str` and
    `spaces_in_tokens` (False for word tokens, which need a space after the
    prompt).
  """
  step_fn: Callable
  params: Any
  init_carry: Callable[[int], Any]
  vocab_size: int
  tokenizer: Any


# --- the math: per-row sampling on the device ------------------------------

def first_argmax(x):
  """int32 [...]: the first index of the largest entry along the last axis
  (a max and a min; XLA's CPU argmax is several times slower)."""
  v = x.shape[-1]
  best = jnp.max(x, -1, keepdims=True)
  iota = jnp.arange(v, dtype=jnp.int32)
  return jnp.minimum(jnp.min(jnp.where(x == best, iota, v), -1), v - 1)


def _order_keys(logits):
  """float32 -> uint32 in the same order (negative floats reversed), so that
  bisection on the keys is bisection on the floats. Finite and infinite
  floats never map to 0 or 0xFFFFFFFF."""
  bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _key_float(key):
  return jax.lax.bitcast_convert_type(
      jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key),
      jnp.float32)


def nucleus(logits, top_p):
  """Keeps the most likely tokens until their probability reaches top_p.

  The cut is the smallest logit value v whose strictly larger logits hold
  less than top_p of the probability; every logit >= v stays (ties with the
  last kept token too). v is found by bisection on the float's bits: 32
  passes over the vocabulary, each a masked sum, instead of sorting it. On a
  CPU, XLA's sort of a [32, 8,192] batch took 47 ms a token, several times
  the LM step it follows; the bisection takes 2.1 ms.

  Args:
    logits: float32 [..., V].
    top_p: a number, or an array broadcasting to [..., 1] (one per row).
  """
  probs = jax.nn.softmax(logits, axis=-1)
  keys = _order_keys(logits)

  def above(key):  # mass of the logits strictly above the float of key
    return jnp.sum(jnp.where(keys > key, probs, 0.0), -1, keepdims=True)

  # Invariant: mass above lo >= top_p > mass above hi.
  lo = jnp.min(keys, -1, keepdims=True) - 1
  hi = jnp.max(keys, -1, keepdims=True)

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    small = above(mid) < top_p
    return jnp.where(small, lo, mid), jnp.where(small, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  return jnp.where(logits < _key_float(hi), -jnp.inf, logits)


def top_k_rows(logits, k):
  """Keeps each row's k largest logits (ties with the k-th too), k per row.

  The k-th largest value is found by bisection on the float's bits, so k is
  data: 32 masked counts over the vocabulary, no sort, no static k.

  Args:
    logits: float32 [rows, V].
    k: int32 [rows, 1]; rows with k <= 0 or k >= V are returned unchanged.
  """
  keys = _order_keys(logits)
  # Invariant: at least k keys are >= lo; fewer than k are > hi.
  lo = jnp.min(keys, -1, keepdims=True)
  hi = jnp.max(keys, -1, keepdims=True)
  kk = jnp.maximum(k, 1)

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo + 1) // 2               # upper middle: progress
    enough = jnp.sum(keys >= mid, -1, keepdims=True) >= kk
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  kept = jnp.where(logits < _key_float(lo), -jnp.inf, logits)
  on = (k > 0) & (k < logits.shape[-1])
  return jnp.where(on, kept, logits)


def filter_rows(logits, temperature, top_k, top_p):
  """Per-row temperature, then top-k, then top-p (HF's order).

  Args:
    logits: float32 [rows, V].
    temperature: float32 [rows]; rows with 0 are left unscaled (greedy rows
      never read the result).
    top_k: int32 [rows]; top_p: float32 [rows].
  Returns:
    float32 [rows, V] for `jax.random.categorical`: kept entries
    `logits / temperature`, the rest -inf. A filter no row uses is skipped.
  """
  logits = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  k = top_k[:, None]
  logits = jax.lax.cond(jnp.any((k > 0) & (k < logits.shape[-1])),
                        lambda x: top_k_rows(x, k), lambda x: x, logits)
  p = top_p[:, None]
  return jax.lax.cond(jnp.any(p < 1),
                      lambda x: jnp.where(p < 1, nucleus(x, p), x),
                      lambda x: x, logits)


def penalize_rows(logits, seen, penalty):
  """CTRL's repetition penalty with one penalty per row ([rows]; 1 = off):
  a seen token's logit is divided by it when positive, multiplied when
  negative."""
  pen = penalty[:, None]
  scaled = jnp.where(logits > 0, logits / pen, logits * pen)
  return jnp.where(seen & (pen != 1), scaled, logits)


def categorical(key, logits):
  """int32: `jax.random.categorical(key, logits)` for one row, the same token
  for the same key: the Gumbel-max draw jax makes (the first argmax of
  `gumbel(key, logits.shape) + logits`), with first_argmax for jnp.argmax,
  which on the CPU took 157 us a token for 64 rows against 62."""
  return first_argmax(
      jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def draw_rows(keys, logits, temperature, top_k, top_p):
  """One token per row: greedy (first argmax) where temperature is 0, else a
  draw from the filtered distribution with the row's own key. A batch of
  greedy rows draws nothing."""
  def draw(logits):
    filtered = filter_rows(logits, temperature, top_k, top_p)
    return jax.vmap(categorical)(keys, filtered)

  drawn = jax.lax.cond(jnp.any(temperature > 0), draw,
                       lambda l: jnp.zeros(l.shape[:1], jnp.int32), logits)
  return jnp.where(temperature == 0, first_argmax(logits), drawn)


def seed_key(seed: int) -> np.ndarray:
  """uint32 [2]: the raw PRNG key of a 64-bit seed. Equal to
  jax.random.PRNGKey(seed) for 0 <= seed < 2**32; larger and negative seeds
  keep their high word instead of losing it."""
  seed = int(seed)
  return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


class _State(NamedTuple):
  """The running batch, all on the device; row r is slot r."""
  carry: Any              # the model state after every consumed token
  logits: jax.Array       # float32 [S, V]: the next token's logits
  seen: jax.Array         # bool [S, V]: tokens in prompt + output
  key: jax.Array          # uint32 [S, 2]: the row's PRNG key
  step: jax.Array         # int32 [S]: tokens the row has drawn
  temperature: jax.Array  # float32 [S]
  top_k: jax.Array        # int32 [S]
  top_p: jax.Array        # float32 [S]
  penalty: jax.Array      # float32 [S]


def _decode(params, state: _State, active, *, step_fn, block):
  """`block` tokens for every slot: (state, tokens int32 [S, block]).

  Rows not decoding (free, or between two chunks of their prompt) keep
  their state and decode greedily without filters, so a filter no busy row
  uses costs nothing; their tokens are never read.
  """
  rows = jnp.arange(state.step.shape[0])
  temperature = jnp.where(active, state.temperature, 0.0)
  top_k = jnp.where(active, state.top_k, 0)
  top_p = jnp.where(active, state.top_p, 1.0)
  penalty = jnp.where(active, state.penalty, 1.0)
  on = active[:, None]

  def one(state, _):
    logits = jax.lax.cond(
        jnp.any(penalty != 1),
        lambda l: penalize_rows(l, state.seen, penalty),
        lambda l: l, state.logits)
    keys = jax.vmap(jax.random.fold_in)(state.key, state.step)
    tokens = draw_rows(keys, logits, temperature, top_k, top_p)
    new_logits, new_carry = step_fn(params, state.carry, tokens)
    # Only busy rows move: a row between two prefill chunks keeps its carry.
    new_carry = jax.tree.map(
        lambda n, o: jnp.where(on, n.astype(o.dtype), o), new_carry,
        state.carry)
    return state._replace(
        carry=new_carry,
        logits=jnp.where(on, new_logits.astype(jnp.float32), state.logits),
        seen=state.seen.at[rows, tokens].max(active),
        step=state.step + active), tokens

  state, tokens = jax.lax.scan(one, state, None, length=block)
  return state, tokens.T


def _prefill(params, state: _State, tokens, lengths, slots, fresh, settings,
             *, step_fn, init_carry):
  """Consumes up to C prompt tokens for each of P rows into their slots.

  Args:
    tokens: int32 [P, C]; row i's first lengths[i] are consumed.
    lengths: int32 [P]; 0 for an unused row.
    slots: int32 [P]; the slot row i lives in; S (out of range) = unused.
    fresh: bool [P]; True: the row's first chunk (zero carry, nothing seen).
    settings: (temperature, top_k, top_p, penalty, key uint32 [P, 2],
      sample_index int32 [P]), written into the rows' slots.
  """
  num_slots = state.step.shape[0]
  take = jnp.minimum(slots, num_slots - 1)
  fresh2 = fresh[:, None]
  carry = jax.tree.map(lambda z, c: jnp.where(fresh2, z, c[take]),
                       init_carry(tokens.shape[0]), state.carry)
  seen = jnp.where(fresh2, False, state.seen[take])
  logits = state.logits[take]
  rows = jnp.arange(tokens.shape[0])

  def one(c, t):
    carry, logits, seen = c
    valid = (t < lengths)[:, None]
    new_logits, new_carry = step_fn(params, carry, tokens[:, t])
    carry = jax.tree.map(lambda n, o: jnp.where(valid, n.astype(o.dtype), o),
                         new_carry, carry)
    logits = jnp.where(valid, new_logits.astype(jnp.float32), logits)
    seen = seen.at[rows, tokens[:, t]].max(valid[:, 0])
    return (carry, logits, seen), None

  (carry, logits, seen), _ = jax.lax.scan(
      one, (carry, logits, seen), jnp.arange(tokens.shape[1]))
  temperature, top_k, top_p, penalty, key, index = settings
  key = jax.vmap(lambda k, j: jnp.where(j == 0, k, jax.random.fold_in(k, j)))(
      key, index)
  put = lambda dst, src: dst.at[slots].set(src, mode="drop")
  return _State(
      carry=jax.tree.map(put, state.carry, carry),
      logits=put(state.logits, logits), seen=put(state.seen, seen),
      key=put(state.key, key), step=put(state.step, jnp.zeros_like(slots)),
      temperature=put(state.temperature, temperature),
      top_k=put(state.top_k, top_k), top_p=put(state.top_p, top_p),
      penalty=put(state.penalty, penalty))


# --- text on the host -------------------------------------------------------

def continuation(tokenizer, prompt: str, ids) -> str:
  """Decoded new tokens as they follow the prompt. Word tokens need a space
  after the prompt; char and byte-level BPE tokens carry their own spaces
  (" world" is one BPE token), so they are joined as they are."""
  text = tokenizer.decode(ids)
  if tokenizer.spaces_in_tokens or not text or prompt[-1:].isspace():
    return text
  return " " + text


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
  """(text before the earliest stop string, whether one was found)."""
  cuts = [text.index(s) for s in stops if s in text]
  return (text[:min(cuts)], True) if cuts else (text, False)


def stream_safe(text: str, stops, final: bool) -> str:
  """The part of `text` that can be sent now: before a stop string found,
  holding back a tail that might be the start of one still to come, and a
  trailing U+FFFD (a UTF-8 character whose other BPE bytes are still to
  come: the next tokens decode it whole)."""
  if not final:
    text = text.rstrip("\ufffd")
  text, found = cut_at_stop(text, stops)
  if found or final or not stops:
    return text
  hold = max(len(s) for s in stops) - 1
  return text[:max(0, len(text) - hold)]


class Completion:
  """One row's request: its growing text and how it ended."""

  def __init__(self, prompt: str, ids: np.ndarray, settings: Settings,
               on_text, on_done):
    self.prompt, self.ids, self.settings = prompt, ids, settings
    self.prompt_tokens = len(ids)
    self.completion_tokens = 0
    self.finish_reason = None
    self.text = ""                 # stream-safe completion so far
    self.error = None
    self._on_text, self._on_done = on_text, on_done
    self._new: list[int] = []      # generated token ids
    self._fed = 0                  # prompt tokens consumed
    self._slot = None
    self._order = 0                # admissions before this one
    self._cancelled = False
    self._finished = threading.Event()

  def cancel(self) -> None:
    """Frees the slot at the next step (or leaves the queue)."""
    self._cancelled = True

  def done(self) -> bool:
    return self._finished.is_set()

  def result(self, timeout=None) -> str:
    """The completion text (the prompt not included), once finished."""
    if not self._finished.wait(timeout):
      raise TimeoutError("the completion did not finish in time")
    if self.error is not None:
      raise RuntimeError(f"generation failed: {self.error}")
    return self.text

  def _emit(self, text: str) -> None:
    if len(text) > len(self.text):
      delta, self.text = text[len(self.text):], text
      if self._on_text is not None:
        self._on_text(delta)

  def _finish(self, reason: str, final_text: str | None = None) -> None:
    if final_text is not None:
      self._emit(final_text)
    self.finish_reason = reason
    self.completion_tokens = len(self._new)
    self._finished.set()
    if self._on_done is not None:
      self._on_done(reason)


class Engine:
  """Owns the running batch and the thread that steps it."""

  def __init__(self, model: Model, *, slots: int = 64, queue: int = 256,
               prefill_chunk: int = 16, prefill_rows: int = 16,
               decode_block: int = 4, max_prompt_tokens: int | None = None,
               name: str = "engine"):
    for label, value in (("slots", slots), ("queue", queue),
                         ("prefill_chunk", prefill_chunk),
                         ("prefill_rows", prefill_rows),
                         ("decode_block", decode_block)):
      if not (isinstance(value, int) and value >= (0 if label == "queue"
                                                   else 1)):
        raise ValueError(f"{label}={value} is not a whole number >= 1")
    self.model, self.tokenizer = model, model.tokenizer
    self.slots, self.queue_limit = slots, queue
    self.chunk, self.prefill_rows = prefill_chunk, min(prefill_rows, slots)
    self.block, self.max_prompt_tokens = decode_block, max_prompt_tokens
    self._traces = 0  # each trace is a new program: a jit cache miss

    def decode(params, state, active):
      self._traces += 1
      return _decode(params, state, active, step_fn=model.step_fn,
                     block=decode_block)

    def prefill(params, state, *args):
      self._traces += 1
      return _prefill(params, state, *args, step_fn=model.step_fn,
                      init_carry=model.init_carry)

    self._decode = jax.jit(decode, donate_argnums=1)
    self._prefill = jax.jit(prefill, donate_argnums=1)
    self._state = self._initial_state()
    self._warm_up()
    self.startup_programs = self.compiled_programs()
    self._pending: collections.deque = collections.deque()
    self._rows: list[Completion | None] = [None] * slots
    self._cond = threading.Condition()
    self._closed = False
    self._steps = self._tokens = self._admitted = 0
    self._finish_times: collections.deque = collections.deque(maxlen=64)
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  # --- device ---

  def _initial_state(self) -> _State:
    s, v = self.slots, self.model.vocab_size
    carry = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                         jax.eval_shape(lambda: self.model.init_carry(s)))
    state = _State(
        carry=carry, logits=np.zeros((s, v), np.float32),
        seen=np.zeros((s, v), bool), key=np.zeros((s, 2), np.uint32),
        step=np.zeros(s, np.int32), temperature=np.zeros(s, np.float32),
        top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
        penalty=np.ones(s, np.float32))
    # Beside the params: one device, or replicated over their mesh.
    leaf = jax.tree.leaves(self.model.params)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = jax.sharding.NamedSharding(sharding.mesh,
                                            jax.sharding.PartitionSpec())
    elif sharding is not None:
      sharding = jax.sharding.SingleDeviceSharding(
          next(iter(sharding.device_set)))
    return jax.device_put(state, sharding)

  def _prefill_args(self, batch):
    """Host arrays for one prefill call over `batch` (Completions)."""
    p, c = self.prefill_rows, self.chunk
    tokens = np.zeros((p, c), np.int32)
    lengths = np.zeros(p, np.int32)
    slots = np.full(p, self.slots, np.int32)
    fresh = np.zeros(p, bool)
    temperature = np.zeros(p, np.float32)
    top_k = np.zeros(p, np.int32)
    top_p = np.ones(p, np.float32)
    penalty = np.ones(p, np.float32)
    key = np.zeros((p, 2), np.uint32)
    index = np.zeros(p, np.int32)
    for i, comp in enumerate(batch):
      part = comp.ids[comp._fed:comp._fed + c]
      tokens[i, :len(part)] = part
      lengths[i], slots[i], fresh[i] = len(part), comp._slot, comp._fed == 0
      st = comp.settings
      temperature[i], top_k[i], top_p[i] = st.temperature, st.top_k, st.top_p
      penalty[i], key[i] = st.repetition_penalty, seed_key(st.seed)
      index[i] = st.sample_index
      comp._fed += len(part)
    return (tokens, lengths, slots, fresh,
            (temperature, top_k, top_p, penalty, key, index))

  def _warm_up(self) -> None:
    """Compiles both programs (twice each: a state that came out of a
    program may be laid out differently from the first, hand-made one)."""
    for _ in range(2):
      self._state = self._prefill(self.model.params, self._state,
                                  *self._prefill_args([]))
      self._state, tokens = self._decode(self.model.params, self._state,
                                         np.zeros(self.slots, bool))
      jax.block_until_ready(tokens)

  def compiled_programs(self) -> int:
    """Programs the engine has traced, each compiled once (or read from the
    persistent compilation cache): a jit cache miss is a trace."""
    return self._traces

  # --- requests ---

  def encode(self, prompt: str, ids=None) -> np.ndarray:
    """The prompt's tokens (`ids` when the caller has them already);
    BadPrompt for none or too many."""
    if not isinstance(prompt, str) or not prompt:
      raise BadPrompt("a prompt is empty: send some text, e.g. 'The '")
    if ids is None:
      ids = self.tokenizer.encode_prompt(prompt)
    ids = np.asarray(ids, np.int32)
    if len(ids) == 0:
      raise BadPrompt("a prompt has no tokens: send some text")
    if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
      raise BadPrompt(f"a prompt of {len(ids)} tokens is too many tokens: at "
                      f"most {self.max_prompt_tokens}")
    return ids

  def submit(self, prompt: str, settings: Settings, on_text=None,
             on_done=None, block: bool = False, ids=None) -> Completion:
    """Queues a request; thread-safe. QueueFull when the queue is full
    (block=True waits for room instead). ids: the prompt's tokens, where the
    caller encoded it already (the server, to check its limits)."""
    settings.check()
    comp = Completion(prompt, self.encode(prompt, ids), settings, on_text,
                      on_done)
    with self._cond:
      while True:
        if self._closed:
          raise RuntimeError("the engine is closed")
        free = self._rows.count(None)
        if len(self._pending) < self.queue_limit + free:
          break
        if not block:
          raise QueueFull(f"all {self.slots} slots are busy and "
                          f"{len(self._pending)} requests wait: retry later",
                          retry_after=self._retry_after())
        self._cond.wait()
      self._pending.append(comp)
      self._cond.notify_all()
    return comp

  def _retry_after(self) -> float:
    """Seconds until the queue has likely moved by one place: the queue's
    length over the rate requests finished lately (1 s with no history)."""
    done = self._finish_times
    if len(done) < 2 or done[-1] <= done[0]:
      return 1.0
    rate = (len(done) - 1) / (done[-1] - done[0])
    return float(min(60.0, max(0.05, (len(self._pending) + 1) / rate)))

  def stats(self) -> dict:
    with self._cond:
      busy = sum(r is not None for r in self._rows)
      queued = len(self._pending)
    return {"slots": self.slots, "busy": busy, "queued": queued,
            "compiled_programs": self.compiled_programs(),
            "startup_programs": self.startup_programs,
            "steps": self._steps, "tokens": self._tokens}

  def close(self) -> None:
    """Stops the thread; unfinished requests end "cancelled"."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    self._thread.join()

  # --- the engine's thread ---

  def _loop(self) -> None:
    try:
      while self._step():
        pass
    except Exception as e:  # pylint: disable=broad-except
      with self._cond:
        failed = [r for r in self._rows if r is not None] + list(
            self._pending)
        self._rows = [None] * self.slots
        self._pending.clear()
        self._closed = True
        self._cond.notify_all()
      logging.getLogger(__name__).exception(
          "the serving engine stopped: %d request(s) failed", len(failed))
      for comp in failed:
        comp.error = e
        self._safe(comp._finish, "error")
      return
    with self._cond:
      left = [r for r in self._rows if r is not None] + list(self._pending)
      self._rows = [None] * self.slots
      self._pending.clear()
    for comp in left:
      self._safe(comp._finish, "cancelled")

  def _safe(self, fn, *args) -> bool:
    """Runs a request's callback; one that raises (a client gone) cancels
    that request and nothing else."""
    try:
      fn(*args)
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  def _admit(self) -> list[Completion]:
    """Moves queued requests into free slots; returns those to drop."""
    dropped = []
    with self._cond:
      while not self._closed and not self._pending and not any(
          r is not None for r in self._rows):
        self._cond.wait()
      if self._closed:
        return None
      for slot, row in enumerate(self._rows):
        if row is not None and row._cancelled:
          self._rows[slot] = None
          dropped.append(row)
      while self._pending and None in self._rows:
        comp = self._pending.popleft()
        if comp._cancelled:
          dropped.append(comp)
          continue
        comp._slot = self._rows.index(None)
        comp._order, self._admitted = self._admitted, self._admitted + 1
        self._rows[comp._slot] = comp
      self._cond.notify_all()  # blocked submitters: room may have appeared
    return dropped

  def _step(self) -> bool:
    dropped = self._admit()
    if dropped is None:
      return False
    for comp in dropped:
      self._safe(comp._finish, "cancelled")
    rows = [r for r in self._rows if r is not None]
    # Oldest first: by slot, a row in a high slot could wait behind ever
    # new prompts in the low ones.
    filling = sorted((r for r in rows if r._fed < len(r.ids)),
                     key=lambda r: r._order)
    if filling:
      self._state = self._prefill(self.model.params, self._state,
                                  *self._prefill_args(
                                      filling[:self.prefill_rows]))
    decoding = [r for r in rows if r._fed == len(r.ids)]
    if not decoding:
      return True
    active = np.zeros(self.slots, bool)
    active[[r._slot for r in decoding]] = True
    self._state, tokens = self._decode(self.model.params, self._state, active)
    tokens = np.asarray(tokens)                         # [S, block]
    self._steps += 1
    for comp in decoding:
      if not self._advance(comp, tokens[comp._slot]):
        comp._cancelled = True
    finished = [r for r in decoding if r.finish_reason is not None]
    if finished:
      now = time.monotonic()
      with self._cond:
        for comp in finished:
          self._rows[comp._slot] = None
          self._finish_times.append(now)
        self._cond.notify_all()
    return True

  def _advance(self, comp: Completion, tokens: np.ndarray) -> bool:
    """Takes a row's new tokens; False if its callback failed."""
    st = comp.settings
    take = tokens[:st.max_new_tokens - len(comp._new)]
    comp._new.extend(int(t) for t in take)
    self._tokens += len(take)
    if not (st.stop or comp._on_text is not None
            or len(comp._new) >= st.max_new_tokens):
      return True  # nothing to look at before the end
    text = continuation(self.tokenizer, comp.prompt, comp._new)
    if st.stop:
      cut, found = cut_at_stop(text, st.stop)
      if found:
        return self._safe(comp._finish, "stop", cut)
    if len(comp._new) >= st.max_new_tokens:
      return self._safe(comp._finish, "length", text)
    return self._safe(comp._emit, stream_safe(text, st.stop, final=False))
