"""Smoke test of `python -m lab.bench --quick`: rows exist, numbers are
positive. No timing assertions: CI machines are shared and noisy.

It runs in a fresh process: the memory rows read process peaks.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quick_bench_writes_every_row(tmp_path):
  path = tmp_path / "bench.json"
  # One CPU device; conftest's JAX_DISABLE_MOST_OPTIMIZATIONS reaches it too.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, "-m", "lab.bench", "--quick", f"--json={path}",
       f"--trace_dir={tmp_path / 'trace'}"],
      capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "tok/s" in out.stdout  # the table was printed
  result = json.loads(path.read_text())

  rows = {r["name"]: r for r in result["rows"]}
  want = {"core_S1", "core_S4", "core_S1_remat", "core_S4_grouped",
          "core_S1_autodiff", "core_S4_autodiff",
          "lm_S1", "lm_S4_grouped", "eval_S1", "eval_S4_grouped",
          "gen_S1_b1", "gen_S1_b4", "gen_S4_grouped_b1", "gen_S4_grouped_b4",
          "gen_S1_b1_nucleus", "gen_S4_grouped_b4_nucleus",
          "word_S1", "word_S4_grouped", "word_S1_adaptive",
          "word_S4_grouped_adaptive", "head_tied", "head_adaptive"}
  if importlib.util.find_spec("torch") is not None:
    want |= {"torch_core_1t", "torch_lm_1t", "torch_eval_1t",
             "torch_word_1t", "torch_word_adaptive_1t", "torch_head_1t",
             "torch_head_adaptive_1t"}
  else:
    assert any("torch not installed" in n for n in result["notes"])
  assert want <= set(rows), sorted(rows)
  # The peak is the best of its shapes, the steps' own among them.
  by_shape = result["matmul_gflops_by_shape"]
  assert {"input projection", "recurrence S=4", "grouped projection S=4",
          "head"} <= set(by_shape)
  torch_by_shape = result["torch_matmul_gflops_by_shape"]
  if importlib.util.find_spec("torch") is not None:
    # torch's matmul of the same shapes, timed beside XLA's; the peak is
    # the best of both.
    assert set(torch_by_shape) == set(by_shape)
    assert all(g > 0 for g in torch_by_shape.values())
  else:
    assert torch_by_shape == {}
  assert result["matmul_peak_gflops"] == pytest.approx(
      max([*by_shape.values(), *torch_by_shape.values()]))
  # Grouped rows count S times fewer projection FLOPs per token than dense.
  core_flops = {n: r["gflops"] * r["ms_per_step"] for n, r in rows.items()}
  assert core_flops["core_S4_grouped"] < core_flops["core_S4"]
  for name, r in rows.items():
    for key in ("tokens_per_s", "ms_per_step", "gflops", "frac_of_peak"):
      assert r[key] > 0, (name, key, r[key])
    if name.startswith(("core", "lm", "eval", "word", "head")) and (
        "torch_core_1t" in rows):
      assert r["ratio_to_torch"] > 0, name
    if not name.startswith(("torch", "gen")):
      assert r["xla_bytes"] > 0, name

  # Rows that multiply in bf16 on this float32 shape (where the CPU's bf16
  # units run them) have torch under autocast(bfloat16) beside them; every
  # "x torch" stays against float32 torch.
  bf16 = {n for n in rows if n.endswith("_bf16") and not n.startswith("torch")}
  if bf16 and "torch_core_1t" in rows:
    assert {"core_S1_native_bf16", "lm_S1_native_fused_bf16",
            "lm_S4_grouped_native_all_bf16",
            "head_tied_fused_bf16"} <= bf16
    for group in ("core", "lm", "head"):
      f32 = min(r["ms_per_step"] for n, r in rows.items()
                if n.startswith(f"torch_{group}_") and "_bf16_" not in n)
      b16 = min(r["ms_per_step"] for n, r in rows.items()
                if n.startswith(f"torch_{group}_bf16_"))
      for n, r in rows.items():
        if n.startswith(group) and n.endswith("_bf16"):
          assert r["ratio_to_torch"] == pytest.approx(f32 / r["ms_per_step"])
          assert r["ratio_to_torch_bf16"] == pytest.approx(
              b16 / r["ms_per_step"])
        elif n.startswith(group):
          assert r["ratio_to_torch_bf16"] is None, n
  else:
    assert not any("_bf16_" in n for n in rows if n.startswith("torch"))

  # --trace_dir: one traced step per JAX row, its device time by kind of op.
  breakdown = result["trace_breakdown"]
  assert set(breakdown) == {n for n in rows if not n.startswith("torch")}
  for name, b in breakdown.items():
    assert b["ops"] > 0 and b["matmul"] > 0, (name, b)
  # model.recurrence=native rows: their time loops are the kernels' calls.
  native = {n for n in rows if "_native" in n}  # _native, _native_cpu_bf16
  assert {"core_S1_native", "core_S4_grouped_native", "lm_S1_native",
          "eval_S4_grouped_native", "word_S1_native",
          "word_S4_grouped_adaptive_native"} <= native
  for name in native:
    assert breakdown[name]["native time loops"] > 0, (name, breakdown[name])
  # The gen rows time the engine users run (its programs, not one layer's
  # step), so they are left out of this check.
  others = {n: b["native time loops"] for n, b in breakdown.items()
            if n not in native and not n.startswith("gen")}
  assert not {n: t for n, t in others.items() if t}, others
  assert "device time of one traced step" in out.stdout

  memory = result["memory"]
  assert {(m["seq_len"], m["remat"]) for m in memory} == {
      (8, False), (16, False), (8, True), (16, True)}
  for m in memory:
    assert m["peak_bytes"] > 0 and m["xla_bytes"] > 0
  # A longer window plans more memory. (Whether remat plans less depends on
  # the shape: test_recurrence checks that it keeps less for the backward.)
  plan = {(m["seq_len"], m["remat"]): m["xla_bytes"] for m in memory}
  assert plan[16, False] > plan[8, False] and plan[16, True] > plan[8, True]
  assert set(result["max_window"]["max_seq_len"]) == {"remat=False",
                                                       "remat=True"}

  # The head rows count the head's own matmuls: the tied head's three
  # [rows, H] x [H, V] products per token, as the LM row counts them.
  shape = result["config"]
  per_token = rows["head_tied"]["gflops"] * 1e9 / rows["head_tied"][
      "tokens_per_s"]
  assert per_token == pytest.approx(3 * 2 * shape["hidden"] * shape["vocab"])


def _bench(args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-m", "lab.bench", *args],
                        capture_output=True, text=True, env=env, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(
                            os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_bench_groups_runs_only_the_groups_named(tmp_path):
  path = tmp_path / "bench.json"
  out = _bench(["--quick", "--memory=false", "--groups=head_adaptive",
                f"--json={path}"])
  assert out.returncode == 0, out.stderr[-3000:]
  names = {r["name"] for r in json.loads(path.read_text())["rows"]}
  assert {n for n in names if not n.startswith("torch")} == {"head_adaptive"}
  assert all(n.startswith("torch_head_adaptive_") for n in names
             if n.startswith("torch"))

  out = _bench(["--quick", "--groups=lm,nope"])
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith(
      "error: --groups: no group nope"), out.stderr[-2000:]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
