"""One exception type for mistakes a user can fix.

Entry points catch `UserError` and print its message as a single line on stderr
(no traceback), then exit non-zero. Messages name the problem and the fix, e.g.
`UserError("data.path 'x' does not exist: point --config.data.path at a folder "
"holding wiki.train.tokens")`.
"""


class UserError(Exception):
  """A bad config value, path, prompt or workdir: the message says how to fix it."""
