"""The serving engine: concurrent requests share one running batch of slots.

An LSTM's whole per-sequence state is (h, c) per layer, the same few KB at
token 1 and token 10,000, so continuous batching is a fixed array of `slots`
rows on the device. A request takes a free slot at any step and frees it
when it finishes; every decode call advances every busy slot by
`decode_block` tokens, or by `small_batch_blocks` times as many while at
most `small_batch_rows` rows decode, no prompt fills and no request waits
(Engine._decode_block_for: where a few rows' call is mostly fixed cost,
fewer calls; a request arriving meanwhile waits for at most that call). A request's sampling parameters (params.py) are
per-row arrays, data to the compiled code, never compile-time constants.
Row r's token i is drawn with `fold_in(key_r, i)`, key_r from the request's
own seed and sample index, and a row's arithmetic never mixes with other
rows', so a request's text does not depend on who else is in the batch.
Stop strings, stop tokens and max tokens are checked on the host after each
call; a row may compute a few tokens past its end, which are dropped: it
ends at the token where a call of one token would have ended it, so its
tokens, log-probabilities and text do not depend on the call's length.

Prompts enter by chunked prefill: `prefill_rows` prompts x `prefill_chunk`
tokens per call, each row stepping the same one-token recurrence as decoding
with a per-row length mask, so a prompt of any length is consumed exactly
(no padding reaches the carry) by ceil(length / chunk) calls of ONE shape.
A prompt whose leading chunks another prompt already consumed starts from
the state cached after them (prefix_cache.py: carry and next-token logits at
a chunk boundary, a few KiB however long the prefix), restored into its
slot by a third program; it then consumes the same chunks a cold start
would, so its tokens and log-probabilities are the same to the bit.

Math that no busy row uses is not in the program that runs: decode is
compiled for two sets of feature groups (params.Features: sampling, the
top-k/top-p/min-p filters, the logit edits (penalties, logit bias,
allowed tokens, min_tokens), log-probabilities): the plain one (greedy
or drawn rows only) and the one with every group; the host runs the
smaller whenever it covers the busy rows' parameters. Prefill is compiled
once with and once without prompt log-probabilities. For a row, a group it
does not use is the identity to the bit, so its tokens and
log-probabilities are the same in every variant that covers its own
groups: what its neighbours use never changes them. The engine therefore
compiles exactly 7 programs (2 prefill; 2 decode at `decode_block` tokens
and 2 at one token, for rows that lack one at most, as scoring's do;
restore; 6 with the prefix cache off), and the 2 decode programs again at
the longer block when small_batch_blocks > 1 (serve's default: 9 in all),
all at start-up, whatever the traffic: stats()["compiled_programs"] counts
their traces (jit cache misses). Every length scans the same one-token
body, so a row's tokens are the same bits in any. Every decode call
computes all slots, busy or not: a program for fewer rows rounds differently (on the CPU a logit's last
bits differed between 8 and 64 rows), so a request's text would depend on
how many ran beside it. On the tiny char model (hidden 32, 2 CPU cores) a
decode call of 4 tokens cost about the same whether 1 slot was busy or 64,
and a 16-token prefill chunk the same for 8 rows as for 16 (so
`prefill_rows` is 16): the calls are overhead-bound, which is why a feature
no row uses is left out of the program rather than skipped by a cond (a
cond is a call on the CPU, at every token).

  params.py     SamplingParams: every knob, its bound, its per-row array
  sampler.py    the per-row math on the device: penalties, filters, draws,
                log-probabilities
  programs.py   the compiled programs over the batch's device state
  prefix_cache.py  prompt prefixes' states, by chained chunk keys, LRU
  scheduler.py  requests and their phases, admission, the stepping thread,
                recovery from a failed step
  text.py       tokens as text: continuation, stop strings, streaming
  wire.py       SamplingParams as the Triton model's inputs and as JSON

No zebra_jax import: `--mode=export` copies this folder next to the Triton
model, which serves through it with the exported functions. The bounds and
types (params, text, wire) import without JAX; the scheduler and the
programs load when first named.
"""

import importlib

from .params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, ParamError,
                     SamplingParams)
from .text import continuation, cut_at_stop, stream_safe
from . import params, text, wire

# The names that need JAX, loaded on first use: reading a bound or a type
# (config/base.py, `zebra-jax fields`, --help) starts no JAX.
_LAZY = {name: "sampler" for name in ("categorical", "first_argmax",
                                      "seed_key")}
_LAZY.update({name: "scheduler" for name in (
    "BadPrompt", "Engine", "EngineClosed", "Model", "Phase", "QueueFull",
    "Request", "Row", "StepFailed", "DEFAULT_PREFIX_CACHE_BYTES")})


def __getattr__(name):
  if name in _LAZY:
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__),
                    name)
    globals()[name] = value
    return value
  if name in ("prefix_cache", "programs", "sampler", "scheduler"):
    return importlib.import_module(f".{name}", __name__)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BadPrompt", "DEFAULT_PREFIX_CACHE_BYTES", "Engine", "EngineClosed", "MAX_LOGIT_BIAS",
           "MAX_LOGPROBS", "Model", "ParamError", "Phase", "QueueFull",
           "Request", "Row", "SamplingParams", "StepFailed", "categorical",
           "continuation", "cut_at_stop", "first_argmax", "seed_key",
           "stream_safe", "wire"]
