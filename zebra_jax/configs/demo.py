"""ZebraLSTM on the embedded offline corpus: the quickstart job, sized for a laptop CPU.

  python -m zebra_jax.main --config=demo --workdir=runs/demo
  python -m zebra_jax.main --config=demo --workdir=runs/demo --mode=eval
  python -m zebra_jax.main --config=demo --workdir=runs/demo --mode=sample \
      --prompt="The module" --config.sample.temperature=0.7
  python -m zebra_jax.main --config=demo:tiny --workdir=/tmp/tiny  # seconds

The corpus is English documentation text shipped with every Python install
(pydoc topics and standard-library docstrings), so it needs no network.

Why 4 dense stripes at hidden 256 (base's model): at equal wall-clock on this
corpus (docs/figures.md, 3 seeds x 3.25 min on 2 CPU cores, with
this config's native time loops) nothing separates from it over characters,
where it reaches the classic LSTM's final perplexity well before the end
of its training time and ends lower; over words dense stripes
(S=8) beat every grouped setting in every column. Grouped S=8 is the fastest
to a loose target but ends above dense S=8 at both levels (seeds apart).

Its time loops: base's model.recurrence=auto, on a CPU compiled C++
(zebra_jax/model/recurrence/native.py), to the same perplexities as the
scan; on a GPU the scan. Without a C++ compiler it runs the scan, with one
warning line.

Its length: 1,500 steps within a time budget of minutes on a laptop's
cores (the README's quickstart; lab/results-log.md holds its timings).
The corpus is the running Python's standard library, so its perplexities
differ a little between Python versions.
"""

import ml_collections

from zebra_jax.config import base


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = base.get_config()  # the embedded corpus, characters, 2 x 256 in 4 stripes
  c.train.update(
      num_steps=1500,           # the quickstart's length: in the docstring
      time_budget_minutes=6.0,  # stop (and save) after this long whatever the step
      eval_every=500,
  )
  c.checkpoint.every_steps = 500
  c.sample.max_new_tokens = 300
  if variant == "tiny":  # same code path, shrunk for tests and smoke runs
    c.model.update(embed_size=32, hidden_size=32)
    c.data.update(batch_size=8, seq_len=16)
    c.train.update(num_steps=20, log_every=5, eval_every=10, eval_max_batches=4,
                   time_budget_minutes=0.0)
    c.eval.update(batch_size=8, seq_len=32)
    c.checkpoint.every_steps = 10
    c.sample.max_new_tokens = 20
  elif variant:
    raise ValueError(f"unknown variant {variant!r}: use demo or demo:tiny")
  return c
