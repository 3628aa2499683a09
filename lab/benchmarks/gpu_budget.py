"""The GPU report's time: every budget in one place, and the device-time
ledger that shows the report fits the node's window.

A GPU node is lent for DEVICE_WINDOW_S in all: its start, every command,
the copy back of the results and its idle wait before it goes back all
count. The report is one command of CALL_BUDGET_S, its stages in order of
value, so that a cold start, the call and the copy back leave enough of
the window to rerun a failed stage on the still-warm node. The docs'
table, the driver, the rehearsal and the tests all read these numbers.
"""

# Stages in the order they run: what is worth most comes first, so a call
# cut short still returns the figures that matter.
STAGES = ("smoke", "kernel", "wt103", "precision", "infer", "scaling",
          "profile")
# Seconds each stage may run on one H100, its process's start included.
# The kernel stage's FlashRNN rows take what its budget has left, so it
# gives way first: infer's wt103 rows compile the engine's programs for
# the recipe's model at three slot counts.
STAGE_BUDGET_S = {"smoke": 25, "kernel": 145, "wt103": 130, "precision": 40,
                  "infer": 55, "scaling": 15, "profile": 40}
CALL_OVERHEAD_S = 30    # outside the stages: jax probe, wheels, driver
CALL_BUDGET_S = 480     # the one command: its timeout on the node
DEVICE_WINDOW_S = 900   # the node's time for the whole report
START_S = 180           # a cold start of the node (one to three minutes)
COPY_BACK_S = 30        # the results folder copied back after the call
RELEASE_S = 30          # the node's idle wait after its last command
COMMAND_LIMIT_S = 600   # the longest one command may run on the node
# What the node sends back of OUT: at most this many files, each at most
# this large (the profile's archives are sized for it).
RETURNED_FILES = 8
RETURNED_FILE_BYTES = 16 * 2 ** 20
# A rerun of named stages must fit what the window has left after the
# call: at least this much, its own overhead and copy back included.
RERUN_MIN_S = 120

# --dry_run on a loaded 2-core CPU: tiny shapes, interpret-mode kernels;
# the rehearsal's call runs under the sum of these and the overhead.
DRY_BUDGET_S = {"smoke": 60, "kernel": 120, "wt103": 90, "precision": 120,
                "infer": 90, "scaling": 60, "profile": 90}


def call_seconds(budgets: dict) -> int:
  """The call's stages and overhead: what its timeout must cover."""
  return sum(budgets.values()) + CALL_OVERHEAD_S


def ledger() -> list[tuple[str, int]]:
  """The device time of one report, in the order it is spent:
  [(what, seconds)], the rerun margin last."""
  spent = [("start", START_S), ("call", CALL_BUDGET_S),
           ("copy-back", COPY_BACK_S)]
  used = sum(s for _, s in spent)
  return spent + [("rerun margin", DEVICE_WINDOW_S - used - RELEASE_S),
                  ("release", RELEASE_S)]


def problems(budgets: dict = STAGE_BUDGET_S) -> list[str]:
  """Why these budgets would not fit the window ([] when they do)."""
  found = []
  if set(budgets) != set(STAGES):
    found.append(f"stages {sorted(budgets)} are not {sorted(STAGES)}")
  need = call_seconds(budgets)
  if need > CALL_BUDGET_S:
    found.append(f"stages {sum(budgets.values())} s + overhead "
                 f"{CALL_OVERHEAD_S} s = {need} s > the call's "
                 f"{CALL_BUDGET_S} s")
  if CALL_BUDGET_S > COMMAND_LIMIT_S:
    found.append(f"the call's {CALL_BUDGET_S} s > one command's "
                 f"{COMMAND_LIMIT_S} s")
  margin = dict(ledger())["rerun margin"]
  if margin < RERUN_MIN_S:
    found.append(f"the rerun margin {margin} s < {RERUN_MIN_S} s")
  return found


def ledger_lines() -> list[str]:
  """The ledger as printed by the rehearsal and shown in the docs."""
  rows = ledger()
  spent = START_S + CALL_BUDGET_S + COPY_BACK_S
  lines = [f"  {what:<13} {s:>4} s" for what, s in rows]
  return ([f"device-time ledger (window {DEVICE_WINDOW_S} s):"] + lines +
          [f"  start + call + copy-back = {spent} s of {DEVICE_WINDOW_S} s;"
           f" a rerun of stages up to "
           f"{dict(rows)['rerun margin'] - CALL_OVERHEAD_S - COPY_BACK_S} s"
           " fits the margin"])


def budget_table(budgets: dict = STAGE_BUDGET_S) -> list[str]:
  """The stages and their budgets as a markdown table, in running order."""
  lines = ["| stage | budget, s |", "|---|---:|"]
  lines += [f"| {s} | {budgets[s]} |" for s in STAGES]
  lines += [f"| (overhead: probe, wheels, driver) | {CALL_OVERHEAD_S} |",
            f"| **the call** | **{CALL_BUDGET_S}** |"]
  return lines
