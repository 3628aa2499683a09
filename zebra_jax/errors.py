"""One exception type for mistakes a user can fix, and the read of a file a
user named that raises it.

Entry points catch `UserError` and print its message as a single line on stderr
(no traceback), then exit non-zero. Messages name the problem and the fix, e.g.
`UserError("data.path 'x' does not exist: point --config.data.path at a folder "
"holding wiki.train.tokens")`.
"""


class UserError(Exception):
  """A bad config value, path, prompt or workdir: the message says how to fix it."""


def read_user_file(path: str, what: str, fix: str) -> str:
  """The text of a file the user named; UserError naming `what` (e.g.
  "--prompt_file") and `fix` when it cannot be read."""
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    reason = getattr(e, "strerror", None) or str(e)
    raise UserError(f"cannot read {what} {path}: {reason}: {fix}") from None
