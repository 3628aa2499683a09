"""The scheduler: requests in, a thread that steps the running batch, text out.

A request moves QUEUED -> PREFILLING -> DECODING -> DONE, each move made by a
`Request` method the engine's thread calls. A request's rows are admitted all
together or not at all, and the queue bound counts requests. An exception in
a step fails the requests in the batch (they end "error"), the device state
is rebuilt from zeros and the engine serves on; after `max_failures` failed
steps in a row, or a failed rebuild, it stops for good: `failure` holds the
cause and `on_fatal` is told, so a server can report unhealthy and exit.
"""

import collections
import dataclasses
import enum
import functools
import itertools
import operator
import logging
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from . import params as params_lib
from . import prefix_cache, programs, text as text_lib
from .params import SamplingParams
from .sampler import seed_key

log = logging.getLogger(__name__)

# 256 MiB of host memory: a word model's entry (its logits over a 10k-word
# vocabulary and a few KiB of carry) is about 45 KB, so some 6,000 chunks,
# about 90,000 prompt tokens at 16 a chunk: many few-shot contexts and
# conversations at once, for less than the process's own footprint.
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20


class QueueFull(Exception):
  """Every slot is busy and `queue` requests already wait."""

  def __init__(self, message: str, retry_after: float):
    super().__init__(message)
    self.retry_after = retry_after


class BadPrompt(ValueError):
  """A prompt the engine cannot take: empty, no tokens, unknown token ids,
  or too long (`too_long`)."""

  def __init__(self, message: str, too_long: bool = False):
    super().__init__(message)
    self.too_long = too_long


class EngineClosed(RuntimeError):
  """The engine stopped: closed, or failed beyond repair (`failure`)."""


class StepFailed(RuntimeError):
  """A request's step raised on the device; the engine carried on."""


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


class Phase(enum.Enum):
  QUEUED = "queued"
  PREFILLING = "prefilling"
  DECODING = "decoding"
  DONE = "done"


@dataclasses.dataclass
class Row:
  """One row to generate: a prompt (text, and its tokens if known) and its
  parameters. on_text(delta, tokens) gets released text and the range of
  generated tokens it completes; on_done(finish_reason) once at the end;
  both run on the engine's thread."""
  prompt: str
  params: SamplingParams
  ids: Any = None
  sample_index: int = 0
  on_text: Callable | None = None
  on_done: Callable | None = None


class Request:
  """One row's progress, its tokens, log-probabilities and text."""

  def __init__(self, row: Row, ids: np.ndarray, group: int):
    self.prompt, self.ids, self.params = row.prompt, ids, row.params
    self.sample_index, self.group = row.sample_index, group
    self.on_text, self.on_done = row.on_text, row.on_done
    self.phase = Phase.QUEUED
    self.slot: int | None = None
    self.order = 0                 # admissions before this one
    self.fed = 0                   # prompt tokens consumed
    self.tokens: list[int] = []    # generated token ids
    self.token_logprobs: list[float] = []
    self.top_logprobs: list[list] = []     # [(id, logprob)] per token
    self.prompt_logprobs: list = []        # None for the first token
    self.prompt_top: list = []
    self.prompt_ranks: list = []           # 1 = the most likely token
    self.stop_token: int | None = None     # the stop token id that ended it
    self.text = ""                 # released completion text
    self.released = 0              # generated tokens released with it
    self.finish_reason: str | None = None
    self.error: BaseException | None = None
    self.cancelled = False
    self._offsets: text_lib.Offsets | None = None
    self._finished = threading.Event()
    self.created = time.monotonic()
    # The row's entries in the batch's arrays, computed once.
    self.packed = params_lib.packed_row(self.params)
    self.features = params_lib.features(self.params)
    self.key = seed_key(self.params.seed)
    self.first_token_at: float | None = None
    self.prefix_keys: list[bytes] | None = None  # set at the first lookup

  @property
  def prompt_tokens(self) -> int:
    return len(self.ids)

  @property
  def completion_tokens(self) -> int:
    """Generated tokens returned (none past a stop string)."""
    return self.released if self.finish_reason else len(self.tokens)

  def cancel(self) -> None:
    """Frees the slot at the next step (or leaves the queue)."""
    self.cancelled = True

  def done(self) -> bool:
    return self._finished.is_set()

  def result(self, timeout=None) -> str:
    """The completion text (the prompt not included), once finished."""
    if not self._finished.wait(timeout):
      raise TimeoutError("the completion did not finish in time")
    if self.error is not None:
      raise StepFailed(f"generation failed: {self.error}") from self.error
    return self.text

  # --- moves, made by the engine's thread ---

  def admit(self, slot: int, order: int) -> None:
    self.phase, self.slot, self.order = Phase.PREFILLING, slot, order

  @property
  def wants_prompt_logprobs(self) -> bool:
    return self.params.prompt_logprobs is not None

  def next_chunk(self, size: int) -> np.ndarray:
    return self.ids[self.fed:self.fed + size]

  def consumed(self, count: int, logprobs=None) -> None:
    """`count` more prompt tokens are in the carry; logprobs: their
    (logprob, top ids, top logprobs, rank) when the row asked for them."""
    if logprobs is not None:
      # Enough alternatives for prompt_logprobs and for echo's logprobs.
      top = max(self.params.prompt_logprobs, self.params.logprobs or 0)
      lps, tops, ranks = _as_lists(logprobs, count, top)
      if self.fed == 0 and count:  # the first token has no context
        lps[0] = tops[0] = ranks[0] = None
      self.prompt_logprobs += lps
      self.prompt_top += tops
      self.prompt_ranks += ranks
    self.fed += count
    if self.fed == len(self.ids):
      self.phase = Phase.DECODING

  def generated(self, tokens: np.ndarray, logprobs=None) -> int:
    """Takes a block of new tokens (those past max_new_tokens, and from a
    stop token on, dropped); returns how many it kept."""
    p = self.params
    take = tokens[:p.max_new_tokens - len(self.tokens)]
    if len(take) and self.first_token_at is None:
      self.first_token_at = time.monotonic()
    if p.stop_token_ids:
      first = len(self.tokens)
      hit = next((k for k, t in enumerate(take) if t in p.stop_token_ids
                  and first + k >= p.min_tokens), None)
      if hit is not None:
        take, self.stop_token = take[:hit], int(take[hit])
    self.tokens.extend(int(t) for t in take)
    if logprobs is not None:
      lps, tops = _as_lists(logprobs, len(take), self.params.logprobs)
      self.token_logprobs += lps
      self.top_logprobs += tops
    return len(take)

  def drop_after(self, count: int) -> None:
    """Forgets the tokens from the count-th on: drawn in the call that
    ended the row, after its end."""
    del self.tokens[count:], self.token_logprobs[count:]
    del self.top_logprobs[count:]
    if self._offsets is not None:
      del self._offsets.ends[count:]
    self.stop_token = None

  def offsets(self, tokenizer) -> text_lib.Offsets:
    if self._offsets is None:
      self._offsets = text_lib.Offsets(tokenizer, self.prompt)
    self._offsets.extend(self.tokens)
    return self._offsets

  def emit(self, text: str, released: int) -> None:
    """Releases text (a longer prefix than before) and the tokens it
    completes."""
    if len(text) > len(self.text) or released > self.released:
      delta, self.text = text[len(self.text):], text
      tokens = range(self.released, max(released, self.released))
      self.released = max(released, self.released)
      if self.on_text is not None:
        self.on_text(delta, tokens)

  def finish(self, reason: str, final_text: str | None = None,
             released: int | None = None, error=None) -> None:
    if final_text is not None:
      self.emit(final_text, len(self.tokens) if released is None
                else released)
    self.finish_reason, self.error, self.phase = reason, error, Phase.DONE
    self._finished.set()
    if self.on_done is not None:
      self.on_done(reason)


def _as_lists(logprobs, count: int, top: int) -> list:
  """The first `count` tokens' (logprob, top ids, top logprobs[, rank])
  arrays as Python lists, the tops as [(id, logprob)] of `top` each: whole
  arrays at once (tolist), the very numbers per-element float() and int()
  give, at a fraction of the cost per token."""
  lps, ids, top_lps, *rest = (x[:count, :top].tolist() if x.ndim == 2
                               else x[:count].tolist() for x in logprobs)
  return [lps, [list(zip(i, v)) for i, v in zip(ids, top_lps)], *rest]


class Engine:
  """Owns the running batch and the thread that steps it."""

  def __init__(self, model: Model, *, slots: int = 64, queue: int = 256,
               prefill_chunk: int = 16, prefill_rows: int = 16,
               decode_block: int = 4, small_batch_blocks: int = 1,
               small_batch_rows: int = 4,
               max_prompt_tokens: int | None = None,
               max_failures: int = 3, on_fatal: Callable | None = None,
               on_step: Callable | None = None, name: str = "engine",
               prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
    for label, value in (("slots", slots), ("queue", queue),
                         ("prefill_chunk", prefill_chunk),
                         ("prefill_rows", prefill_rows),
                         ("decode_block", decode_block),
                         ("small_batch_blocks", small_batch_blocks),
                         ("small_batch_rows", small_batch_rows),
                         ("prefix_cache_bytes", prefix_cache_bytes)):
      least = 0 if label in ("queue", "prefix_cache_bytes") else 1
      if not (isinstance(value, int) and value >= least):
        raise ValueError(f"{label}={value} is not a whole number >= {least}")
    self.model, self.tokenizer = model, model.tokenizer
    self.slots, self.queue_limit = slots, queue
    self.chunk, self.prefill_rows = prefill_chunk, min(prefill_rows, slots)
    self.block, self.max_prompt_tokens = decode_block, max_prompt_tokens
    # Few rows decoding, none filling or waiting: longer calls, fewer
    # dispatches (each call's cost is mostly fixed overhead).
    self.long_block = decode_block * small_batch_blocks
    self.small_batch_rows = small_batch_rows
    self.max_failures, self.on_fatal, self.on_step = (max_failures, on_fatal,
                                                      on_step)
    self._traces = 0  # each trace is a new program: a jit cache miss

    def decode(params, state, active, features, block):
      self._traces += 1
      return programs.decode(params, state, active, step_fn=model.step_fn,
                             block=block, features=features)

    def prefill(params, state, *args, with_logprobs):
      self._traces += 1
      return programs.prefill(params, state, *args, step_fn=model.step_fn,
                              init_carry=model.init_carry,
                              with_logprobs=with_logprobs)

    def restore(state, *args):
      self._traces += 1
      return programs.restore(state, *args)

    self._decode = jax.jit(decode, donate_argnums=1, static_argnums=(3, 4))
    self._prefill = jax.jit(prefill, donate_argnums=1,
                            static_argnames="with_logprobs")
    # 0 bytes: no cache, and no restore program.
    self._cache = (prefix_cache.PrefixCache(prefix_cache_bytes)
                   if prefix_cache_bytes else None)
    self._restore = jax.jit(restore, donate_argnums=0)
    self._new_params = None  # set_params's, taken at the next step
    self._blank_carry = None  # _carry_template's
    self._state = self._device_state()
    self._warm_up()
    self.startup_programs = self.compiled_programs()
    self._pending: collections.deque = collections.deque()
    self._waiting_groups: collections.Counter = collections.Counter()
    self._groups = itertools.count()
    self._rows: list[Request | None] = [None] * slots
    self._cond = threading.Condition()
    self._closed = False
    self.failure: BaseException | None = None
    self._steps = self._tokens = self._admitted = self._restarts = 0
    self._long_steps = 0
    self._prompt_tokens = self._prefill_tokens = self._prefill_calls = 0
    self._finish_times: collections.deque = collections.deque(maxlen=64)
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  # --- device ---

  def _device_state(self) -> programs.State:
    state = programs.initial_state(self.model.init_carry, self.slots,
                                   self.model.vocab_size)
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

  def _prefill_args(self, batch: list[Request]):
    """Host arrays for one prefill call over `batch`."""
    p, c = self.prefill_rows, self.chunk
    tokens = np.zeros((p, c), np.int32)
    lengths = np.zeros(p, np.int32)
    fresh = np.zeros(p, bool)
    for i, req in enumerate(batch):
      part = req.next_chunk(c)
      tokens[i, :len(part)] = part
      lengths[i], fresh[i] = len(part), req.fed == 0
    slots, key, index, row = self._slot_args(batch)
    return tokens, lengths, slots, fresh, key, index, row

  def _slot_args(self, batch: list[Request]):
    """(slots, keys, sample indices, parameters) of `batch`'s rows, padded
    to prefill_rows with rows that write nothing."""
    p = self.prefill_rows
    slots = np.full(p, self.slots, np.int32)
    key = np.zeros((p, 2), np.uint32)
    index = np.zeros(p, np.int32)
    for i, req in enumerate(batch):
      slots[i], key[i], index[i] = req.slot, req.key, req.sample_index
    row = params_lib.packed_batch([req.packed for req in batch], p)
    return slots, key, index, row

  def _carry_template(self):
    """A prefill call's carry as host zeros: the leaves' shapes and dtypes
    (traced once, not per call)."""
    if self._blank_carry is None:
      self._blank_carry = programs.initial_state(
          self.model.init_carry, self.prefill_rows, 1).carry
    return self._blank_carry

  def _restore_args(self, batch: list[tuple[Request, Any]]):
    """Host arrays for one restore call: (request, cache entry) pairs."""
    p, vocab = self.prefill_rows, self.model.vocab_size
    carry = jax.tree.map(np.zeros_like, self._carry_template())
    logits = np.zeros((p, vocab), np.float32)
    seen = np.zeros((p, vocab), bool)
    for i, (req, entry) in enumerate(batch):
      for dst, src in zip(jax.tree.leaves(carry), entry.carry):
        dst[i] = src
      logits[i] = entry.logits
      seen[i, req.ids[:req.fed]] = True
    slots, key, index, row = self._slot_args([req for req, _ in batch])
    return slots, carry, logits, seen, key, index, row

  def _warm_up(self) -> None:
    """Compiles the programs (twice each: a state that came out of a
    program may be laid out differently from the first, hand-made one)."""
    idle = np.zeros(self.slots, bool)
    for _ in range(2):
      for with_logprobs in (False, True):
        self._state, _, _ = self._prefill(
            self.model.params, self._state, *self._prefill_args([]),
            with_logprobs=with_logprobs)
      for features, block in itertools.product(params_lib.DECODE_VARIANTS,
                                               self.decode_blocks()):
        self._state, tokens, _ = self._decode(self.model.params, self._state,
                                              idle, features, block)
      if self._cache is not None:
        self._state = self._restore(self._state, *self._restore_args([]))
      jax.block_until_ready((tokens, self._state))

  def decode_blocks(self) -> tuple[int, ...]:
    """The decode calls' lengths in tokens: one, decode_block, and the
    small batch's longer one when small_batch_blocks > 1."""
    return tuple(sorted({1, self.block, self.long_block}))

  def compiled_programs(self) -> int:
    """Programs the engine has traced, each compiled once (or read from the
    persistent compilation cache): a jit cache miss is a trace."""
    return self._traces

  def set_params(self, params) -> None:
    """New weights of the same layout (the programs stay valid), taken by
    the engine's thread at its next step, when it also empties the prefix
    cache: no state computed with the old weights serves a later prompt."""
    with self._cond:
      self._new_params = params
      self._cond.notify_all()

  # --- requests ---

  def encode(self, prompt: str, ids=None) -> np.ndarray:
    """The prompt's tokens (`ids` when the caller has them already, checked
    against the vocabulary); BadPrompt for none or too many."""
    if ids is None:
      if not isinstance(prompt, str) or not prompt:
        raise BadPrompt("a prompt is empty: send some text, e.g. 'The '")
      ids = self.tokenizer.encode_prompt(prompt)
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or len(ids) == 0:
      raise BadPrompt("a prompt has no tokens: send some text")
    if ids.min() < 0 or ids.max() >= self.model.vocab_size:
      raise BadPrompt(f"a prompt holds token ids outside the vocabulary "
                      f"[0, {self.model.vocab_size})")
    if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
      raise BadPrompt(f"a prompt of {len(ids)} tokens is too many tokens: at "
                      f"most {self.max_prompt_tokens}", too_long=True)
    return ids.astype(np.int32)

  def submit(self, prompt: str, params: SamplingParams, on_text=None,
             on_done=None, block: bool = False, ids=None,
             sample_index: int = 0) -> Request:
    """One row; see submit_many."""
    return self.submit_many([Row(prompt, params, ids, sample_index, on_text,
                                 on_done)], block=block)[0]

  def submit_many(self, rows: list[Row], block: bool = False
                  ) -> list[Request]:
    """Queues one request's rows, all or none; thread-safe. Rows without a
    seed share one fresh seed (each draws from its own sample_index).
    QueueFull when the queue holds `queue` requests already (block=True
    waits for room instead); ValueError for bad parameters or prompts."""
    fresh_seed = SamplingParams().with_seed().seed
    requests = []
    group = next(self._groups)
    for row in rows:
      row.params.check(self.model.vocab_size)
      if row.params.seed is None:
        row = dataclasses.replace(row, params=dataclasses.replace(
            row.params, seed=fresh_seed))
      requests.append(Request(row, self.encode(row.prompt, row.ids), group))
    with self._cond:
      while True:
        if self._closed:
          raise EngineClosed(self._closed_reason())
        fits, waiting = self._room(len(requests))
        if fits or waiting < self.queue_limit:
          break
        if not block:
          raise QueueFull(f"all {self.slots} slots are busy and {waiting} "
                          "requests wait: retry later",
                          retry_after=self._retry_after())
        self._cond.wait()
      self._pending.extend(requests)
      self._waiting_groups[group] += len(requests)
      self._cond.notify_all()
    return requests

  def _room(self, rows: int) -> tuple[bool, int]:
    """(whether `rows` would find free slots at the next step, requests
    that would still wait): queued requests take the free slots first, in
    order of arrival; a finished row's slot counts as free."""
    free = sum(r is None or r.done() for r in self._rows)
    waiting = 0
    for count in self._waiting_groups.values():  # in order of arrival
      if count <= free:
        free -= count
      else:
        free, waiting = 0, waiting + 1
    return rows <= free and not waiting, waiting

  def _closed_reason(self) -> str:
    if self.failure is not None:
      return (f"the engine stopped after a failure it could not recover "
              f"from: {type(self.failure).__name__}: {self.failure}")
    return "the engine is closed"

  def _retry_after(self) -> float:
    """Seconds until the queue has likely moved by one place: the queue's
    length over the rate requests finished lately (1 s with no history)."""
    done = self._finish_times
    if len(done) < 2 or done[-1] <= done[0]:
      return 1.0
    rate = (len(done) - 1) / (done[-1] - done[0])
    return float(min(60.0, max(0.05, (len(self._pending) + 1) / rate)))

  @property
  def healthy(self) -> bool:
    return self.failure is None and self._thread.is_alive()

  def stats(self) -> dict:
    with self._cond:
      # A finished row frees its slot at the end of the step.
      busy = sum(r is not None and not r.done() for r in self._rows)
      queued, waiting = len(self._pending), self._room(0)[1]
    cache = (self._cache.stats() if self._cache is not None else
             prefix_cache.PrefixCache(0).stats())
    return {"slots": self.slots, "busy": busy, "queued": queued,
            "queued_requests": waiting,
            "compiled_programs": self.compiled_programs(),
            "startup_programs": self.startup_programs,
            "steps": self._steps, "small_batch_steps": self._long_steps,
            "tokens": self._tokens,
            "prompt_tokens": self._prompt_tokens,
            "prefill_tokens": self._prefill_tokens,
            "prefill_calls": self._prefill_calls,
            "restarts": self._restarts, "healthy": self.healthy, **cache}

  def close(self) -> None:
    """Stops the thread; unfinished requests end "cancelled"."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    self._thread.join()

  # --- the engine's thread ---

  def _loop(self) -> None:
    failures = 0
    while True:
      try:
        if not self._step():
          break
        failures = 0
      except Exception as e:  # pylint: disable=broad-except
        failures += 1
        if failures > self.max_failures:
          # Unhealthy before any request hears of it: a client that reads
          # its 500 and then asks /health must see the failure.
          error = RuntimeError(f"{failures} steps in a row failed: "
                               f"{type(e).__name__}: {e}")
          error.__cause__ = e
          self._die(error)
          return
        self._restarts += 1
        batch = self._fail_batch(e)
        log.exception("an engine step failed: %d request(s) in the batch "
                      "failed; the engine rebuilds its state", batch)
        try:
          self._state = self._device_state()
        except Exception as fatal:  # pylint: disable=broad-except
          self._die(fatal)
          return
    self._end_all("cancelled")

  def _fail_batch(self, error) -> int:
    """Fails every request in a slot (they were in the failed step)."""
    with self._cond:
      failed = [r for r in self._rows if r is not None]
      self._rows = [None] * self.slots
      self._cond.notify_all()
    for req in failed:
      self._safe(req.finish, "error", None, None, error)
    return len(failed)

  def _die(self, error) -> None:
    log.error("the serving engine stopped: %s: %s", type(error).__name__,
              error)
    with self._cond:
      self.failure, self._closed = error, True
      self._cond.notify_all()
    if self.on_fatal is not None:
      self._safe(self.on_fatal, error)
    self._end_all("error", error)

  def _end_all(self, reason: str, error=None) -> None:
    with self._cond:
      left = [r for r in self._rows if r is not None] + list(self._pending)
      self._rows = [None] * self.slots
      self._pending.clear()
      self._waiting_groups.clear()
      self._cond.notify_all()
    for req in left:
      self._safe(req.finish, reason, None, None, error)

  def _safe(self, fn, *args) -> bool:
    """Runs a request's callback; one that raises (a client gone) cancels
    that request and nothing else."""
    try:
      fn(*args)
      return True
    except Exception:  # pylint: disable=broad-except
      return False

  def _admit(self) -> list[Request] | None:
    """Moves queued requests into free slots; returns those to drop."""
    dropped = []
    with self._cond:
      while not self._closed and not self._pending and not any(
          r is not None for r in self._rows) and self._new_params is None:
        self._cond.wait()
      if self._closed:
        return None
      if self._new_params is not None:
        self.model.params, self._new_params = self._new_params, None
        if self._cache is not None:
          self._cache.clear()
      for slot, req in enumerate(self._rows):
        if req is not None and req.cancelled:
          self._rows[slot] = None
          dropped.append(req)
      while self._pending and None in self._rows:
        req = self._pending.popleft()
        self._left_queue(req)
        if req.cancelled:
          dropped.append(req)
          continue
        req.admit(self._rows.index(None), self._admitted)
        self._admitted += 1
        self._rows[req.slot] = req
      self._cond.notify_all()  # blocked submitters: room may have appeared
    return dropped

  def _left_queue(self, req: Request) -> None:
    self._waiting_groups[req.group] -= 1
    if self._waiting_groups[req.group] <= 0:
      del self._waiting_groups[req.group]

  def _step(self) -> bool:
    dropped = self._admit()
    if dropped is None:
      return False
    start = time.perf_counter()
    for req in dropped:
      self._safe(req.finish, "cancelled")
    rows = [r for r in self._rows if r is not None]
    # Oldest first: by slot, a row in a high slot could wait behind ever
    # new prompts in the low ones.
    filling = sorted((r for r in rows if r.phase is Phase.PREFILLING),
                     key=lambda r: r.order)
    if self._cache is None:
      filling = filling[:self.prefill_rows]
    else:
      filling = self._resume_from_cache(filling)
    settle = self._prefill_batch(filling) if filling else None
    decoding = [r for r in rows if r.phase is Phase.DECODING
                and r.params.max_new_tokens > 0]
    if decoding:  # settles the prefill once the decode call is under way
      self._decode_batch(decoding, self._decode_block_for(rows, decoding),
                         settle)
    elif settle is not None:
      settle()
    done = [r for r in rows if r.phase is Phase.DONE]
    if done:
      now = time.monotonic()
      with self._cond:
        for req in done:
          self._rows[req.slot] = None
          self._finish_times.append(now)
        self._cond.notify_all()
    if (filling or decoding) and self.on_step is not None:
      self._safe(self.on_step, time.perf_counter() - start)
    return True

  def _prefill_batch(self, filling: list[Request]) -> Callable[[], None]:
    """One prefill call. Returns what settles it: with the cache, storing
    what each row ended at (which waits for the call), then finishing the
    rows that only score their prompt. The step runs it once the decode
    call is dispatched, so the wait overlaps that call as it does without
    the cache, and before any row can finish: a request that follows
    finds the states cached."""
    args = self._prefill_args(filling)
    keys = [r.prefix_keys[r.fed // self.chunk] if r.prefix_keys else None
            for r in filling]
    want = any(r.wants_prompt_logprobs for r in filling)
    self._state, logprobs, rows = self._prefill(
        self.model.params, self._state, *args, with_logprobs=want)
    self._prefill_calls += 1
    logprobs = jax.device_get(logprobs) if want else None
    for i, req in enumerate(filling):
      mine = (tuple(x[i] for x in logprobs)
              if want and req.wants_prompt_logprobs else None)
      self._prefill_tokens += int(args[1][i])
      self._consume(req, int(args[1][i]), mine, finish=False)

    def settle():
      if self._cache is not None:
        self._store(filling, keys, args[1], logprobs, rows)
      for req in filling:
        self._finish_scoring(req)
    return settle

  def _consume(self, req: Request, count: int, logprobs,
               finish: bool = True) -> None:
    req.consumed(count, logprobs)
    self._prompt_tokens += count
    if finish:
      self._finish_scoring(req)

  def _finish_scoring(self, req: Request) -> None:
    if req.phase is Phase.DECODING and req.params.max_new_tokens == 0:
      self._safe(req.finish, "length", "", 0)  # the prompt alone: scoring

  # --- the prefix cache ---

  def _resume_from_cache(self, waiting: list[Request]) -> list[Request]:
    """Moves rows (oldest first) past their cached prefix, restoring that
    state into their slots; returns the rows to prefill now, at most
    prefill_rows. A row whose next chunk an older row computes in this call
    waits for it (then finds it cached): a prefix shared by rows admitted
    together (n > 1, several prompts) is computed once."""
    batch, restored, computing = [], [], {}
    for req in waiting:
      if len(batch) == self.prefill_rows:
        break
      entry = self._lookup(req)
      # A row the cache finished (scoring: max_tokens=0) needs no state.
      if entry is not None and req.phase is not Phase.DONE:
        restored.append((req, entry))
      if req.phase is not Phase.PREFILLING:
        continue
      key, wants = req.prefix_keys[req.fed // self.chunk], (
          req.wants_prompt_logprobs)
      if key in computing and (computing[key] or not wants):
        continue
      computing[key] = computing.get(key, False) or wants
      batch.append(req)
    for start in range(0, len(restored), self.prefill_rows):
      self._state = self._restore(self._state, *self._restore_args(
          restored[start:start + self.prefill_rows]))
    return batch

  def _lookup(self, req: Request):
    """Consumes the cached chunks from the row's next one on; returns the
    last one's entry (None if none was cached)."""
    cache = self._cache
    if req.prefix_keys is None:
      req.prefix_keys = prefix_cache.chunk_keys(req.ids, self.chunk)
      cache.queries += len(req.ids)
    last, wants = None, req.wants_prompt_logprobs
    for key in req.prefix_keys[req.fed // self.chunk:]:
      entry = cache.get(key, wants)
      if entry is None:
        break
      cache.hits += entry.tokens
      self._consume(req, entry.tokens, entry.logprobs if wants else None)
      last = entry
    return last

  def _store(self, filling: list[Request], keys, counts, logprobs,
             rows) -> None:
    """Caches the state each row of the last prefill call ended at."""
    new = self._cache.missing(keys, [r.wants_prompt_logprobs
                                     for r in filling])
    if not new:
      return
    # The call's states in one array; each entry copies its row (its own
    # memory: an evicted entry frees what it counted), the carry as its
    # leaves, which is all the restore reads.
    rows = np.asarray(rows)
    for i in new:
      req, count = filling[i], int(counts[i])
      mine = (tuple(x[i, :count].copy() for x in logprobs)
              if req.wants_prompt_logprobs else None)
      carry, logits = programs.unpack_row(rows[i], self._carry_template())
      self._cache.put(keys[i], prefix_cache.Entry(
          carry=carry, logits=logits, tokens=count, logprobs=mine))

  def _decode_block_for(self, rows: list[Request],
                        decoding: list[Request]) -> int:
    """The long block while at most small_batch_rows rows decode, each
    with tokens drawn already and at least the long block still to draw,
    no row fills its prompt and no request waits: a request arriving
    meanwhile waits for at most this one call. One token while no row
    lacks more (scoring's max_tokens=1, a request's last token): a call's
    cost on a CPU is its tokens' compute over every slot. Else
    decode_block: prompts
    and queued requests move at the usual pace, a row's first tokens
    come as soon as before, and no call draws past a row's max tokens
    more than decode_block does."""
    if all(r.params.max_new_tokens - len(r.tokens) <= 1 for r in decoding):
      return 1  # each row lacks one token at most (a scoring request's)
    if (len(decoding) > self.small_batch_rows or self._pending
        or any(r.phase is Phase.PREFILLING for r in rows)
        or any(not r.tokens or r.params.max_new_tokens - len(r.tokens)
               < self.long_block for r in decoding)):
      return self.block
    return self.long_block

  def _decode_batch(self, decoding: list[Request], block: int,
                    settle: Callable[[], None] | None = None) -> None:
    active = np.zeros(self.slots, bool)
    active[[r.slot for r in decoding]] = True
    features = params_lib.variant_for(functools.reduce(
        operator.or_, (r.features for r in decoding)))
    self._state, tokens, logprobs = self._decode(
        self.model.params, self._state, active, features, block)
    if settle is not None:
      settle()
    tokens = np.asarray(tokens)                         # [S, block]
    want = features.logprobs
    logprobs = jax.device_get(logprobs) if want else None
    self._steps += 1
    self._long_steps += block > self.block
    for req in decoding:
      mine = (tuple(x[req.slot] for x in logprobs)
              if want and req.params.logprobs is not None else None)
      before = len(req.tokens)
      new = req.generated(tokens[req.slot], mine)
      if not self._safe(self._advance, req, new):
        req.cancel()
      self._tokens += len(req.tokens) - before

  def _advance(self, req: Request, new: int) -> None:
    """Stop strings, stop tokens, the end, and streamed text after `new`
    tokens."""
    p = req.params
    stopped = req.stop_token is not None
    at_end = stopped or len(req.tokens) >= p.max_new_tokens
    track = p.logprobs is not None
    if not (p.stop or req.on_text is not None or at_end):
      return  # nothing to look at before the end
    text = text_lib.continuation(self.tokenizer, req.prompt, req.tokens)
    # A stop string counts where it begins after the first min_tokens
    # tokens' text.
    start = 0
    if p.stop and p.min_tokens:
      start = (req.offsets(self.tokenizer).start(p.min_tokens)
               if len(req.tokens) >= p.min_tokens else len(text))
    if p.stop:
      cut, found = text_lib.cut_at_stop(text, p.stop, start)
      if found:
        first = self._first_stop(req, new, start)
        cut = cut if first is None else first
        kept = req.offsets(self.tokenizer).touching(len(cut))
        req.finish("stop", cut, kept)
        return
    if at_end:
      req.finish("stop" if stopped else "length", text)
      return
    safe = text_lib.stream_safe(text, p.stop, final=False, start=start)
    released = (req.offsets(self.tokenizer).covered(len(safe)) if track
                else 0)
    req.emit(safe, released)

  def _first_stop(self, req: Request, new: int, start: int) -> str | None:
    """The text before a stop string at the first of the `new` tokens
    whose text holds one, the row cut there: where a call of one token
    would have ended it (a call draws on past that token, and a longer
    stop string beginning earlier may complete only after it). None if no
    shorter text holds one."""
    p = req.params
    for count in range(max(len(req.tokens) - new + 1, p.min_tokens),
                       len(req.tokens) + 1):
      cut, found = text_lib.cut_at_stop(text_lib.continuation(
          self.tokenizer, req.prompt, req.tokens[:count]), p.stop, start)
      if found:
        req.drop_after(count)
        return cut
    return None
