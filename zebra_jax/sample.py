"""--mode=sample: generate text from a prompt with a trained workdir.

The prompt is consumed once as a window; then each new token is one step of the
recurrence with the (h, c) carry, inside one jitted loop (zebra_jax.sampling),
so the cost per token does not grow with the length of the text.
"""

import functools

import jax
import numpy as np

from zebra_jax import model, sampling, setup
from zebra_jax.errors import UserError


def _consume_prompt(params, tokens, carry, *, graphdef):
  """Runs the prompt [B, T] through the model: (last logits [B, V], carry)."""
  logits, carry = model.apply(graphdef, params, tokens, carry)
  return logits[:, -1], carry


def _one_token(params, carry, tokens, *, graphdef):
  """The recurrent step sampling.generate calls: tokens [B] -> logits [B, V]."""
  logits, carry = model.apply(graphdef, params, tokens[:, None], carry)
  return logits[:, 0], carry


def generate_text(loaded: setup.Loaded, prompt: str, *, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float,
                  num_samples: int, seed: int) -> list[str]:
  """Returns num_samples continuations (prompt included) of `prompt`."""
  if not prompt:
    raise UserError("the prompt is empty: pass --prompt='some text'")
  ids = np.asarray(loaded.tokenizer.encode_prompt(prompt), np.int32)
  if ids.size == 0:
    raise UserError(f"the prompt {prompt!r} has no tokens: pass some text")
  tokens = np.tile(ids[None, :], (num_samples, 1))
  carry = model.init_carry(loaded.cfg.model, num_samples)
  consume = jax.jit(functools.partial(_consume_prompt, graphdef=loaded.graphdef))
  last_logits, carry = consume(loaded.params, tokens, carry)
  step_fn = functools.partial(_one_token, graphdef=loaded.graphdef)
  new_tokens, _ = sampling.generate(
      step_fn, loaded.params, carry, last_logits, jax.random.PRNGKey(seed),
      num_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
      top_p=top_p)
  new_tokens = np.asarray(jax.device_get(new_tokens))
  return [_join(loaded.tokenizer, prompt, row) for row in new_tokens]


def _join(tokenizer, prompt: str, ids) -> str:
  """Prompt + decoded continuation; word tokens need a separating space."""
  text = tokenizer.decode(ids)
  if tokenizer.kind == "char" or prompt[-1:].isspace():
    return prompt + text
  return prompt + " " + text


def run(cfg, workdir: str) -> list[str]:
  loaded = setup.load_for_inference(cfg, workdir)
  s = cfg.sample
  texts = generate_text(loaded, s.prompt, max_new_tokens=s.max_new_tokens,
                        temperature=s.temperature, top_k=s.top_k,
                        top_p=s.top_p, num_samples=s.num_samples, seed=s.seed)
  if jax.process_index() == 0:
    for i, text in enumerate(texts):
      print(f"----- sample {i + 1}/{len(texts)} (step {loaded.step}, "
            f"temperature {s.temperature}) -----\n{text}\n", flush=True)
  return texts
