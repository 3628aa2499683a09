"""Fixed-width text tables: the benchmarks print their rows through one
helper, so every table lines up the same way (the name left, figures right).
"""

from typing import Callable, Sequence

from zebra_jax import strict_json

# (title, width, the cell's text for a row)
Column = tuple[str, int, Callable[[dict], str]]


def ratio_text(ratio: float | None) -> str:
  """A speed ratio to two decimals, "-" where there is none."""
  return "-" if ratio is None else f"{ratio:.2f}"


def speed_columns(name_width: int, tokens_width: int) -> list[Column]:
  """The columns every speed table starts with: row, tok/s, ms/step and the
  ratio to torch."""
  return [("row", name_width, lambda r: r["name"]),
          ("tok/s", tokens_width, lambda r: f"{r['tokens_per_s']:,.0f}"),
          ("ms/step", 10, lambda r: f"{r['ms_per_step']:.1f}"),
          ("x torch", 9, lambda r: ratio_text(r["ratio_to_torch"]))]


def print_and_save(result: dict, print_table: Callable[[dict], None],
                   json_path: str | None) -> dict:
  """Prints a benchmark's result as its table, and writes it as JSON to
  json_path when one is given; returns it."""
  print_table(result)
  if json_path:
    with open(json_path, "w") as f:
      strict_json.dump(result, f, indent=1)
  return result


def load_column() -> Column:
  """The 1-minute load average before and after a row: a loaded machine
  slows every row, so a table says how loaded it was."""
  return ("load before/after", 19,
          lambda r: f"{r['load_before']:.2f} / {r['load_after']:.2f}")


def print_rows(rows: Sequence[dict], columns: Sequence[Column]) -> None:
  """A header line, then one line per row; the first column left-aligned."""
  widths = [width for _, width, _ in columns]

  def line(cells: list[str]) -> str:
    return f"{cells[0]:<{widths[0]}}" + "".join(
        f"{cell:>{width}}" for cell, width in zip(cells[1:], widths[1:]))

  print(line([title for title, _, _ in columns]))
  for r in rows:
    print(line([text(r) for _, _, text in columns]))


def print_step_rows(title: str, rows: Sequence[dict], ratio_key: str,
                    ratio_label: str, name_width: int,
                    digits: int = 2) -> None:
  """A GPU tool's rows under a title: the name, ms/step and the row's
  ratio (where it has one), or its error."""
  print(f"\n{title}")
  for r in rows:
    if "ms_per_step" not in r:
      figure = f"  {r['error']}"
    else:
      figure = f"{r['ms_per_step']:8.2f} ms/step" + (
          f"  {r[ratio_key]:.{digits}f} x {ratio_label}"
          if ratio_key in r else "")
    print(f"  {r['name']:<{name_width}} {figure}")
