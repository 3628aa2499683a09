"""The configs that ship with the package: --config=NAME[:variant].

base.py (every field at its default), demo.py (the quickstart, sized for a
laptop CPU), wt103.py (WikiText-103 on a multi-GPU node) and lm1b.py (the
One Billion Word benchmark through TFDS, on one GPU), wlm.py (PyTorch's
word_language_model example's recipe). Each defines
get_config(variant); `--config=demo:tiny` runs demo.py's tiny variant from
any directory. A config of one's own is a file that defines get_config() the
same way, passed by its path: --config=path/to/mine.py[:variant].
"""
