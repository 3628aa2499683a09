"""Trace reading: ops sorted by kind (HLO names) and by part of the step
(named scopes)."""

from lab.benchmarks import traces


def test_op_kinds_from_hlo_names():
  kinds = {name: traces.op_kind(name) for name in (
      "ynn_fusion.3", "dot.1", "cublas-gemm.2", "copy.5",
      "bitcast_dynamic-update-slice_fusion.1", "concatenate.2",
      "wrapped_copy", "add_divide_fusion.7", "subtract_multiply_fusion",
      "while.1", "loop_fusion.4", "custom-call.3", "ffi_call.20")}
  assert kinds == {
      "ynn_fusion.3": "matmul", "dot.1": "matmul",
      "cublas-gemm.2": "matmul", "copy.5": "data movement",
      "bitcast_dynamic-update-slice_fusion.1": "data movement",
      "concatenate.2": "data movement", "wrapped_copy": "data movement",
      "add_divide_fusion.7": "elementwise & other",
      "subtract_multiply_fusion": "elementwise & other", "while.1": None,
      "loop_fusion.4": "elementwise & other",
      "custom-call.3": "native time loops",
      "ffi_call.20": "native time loops"}


def test_scope_categories_from_named_scopes():
  c = traces.scope_category
  assert c("jit(step)/transpose(jvp(zebra_lstm_1))/dot_general") \
      == "lstm_layers"
  assert c("jit(step)/transpose(jvp(head))/dot_general") == "head"
  assert c("jit(step)/jvp(loss)/reduce_sum") == "head"
  assert c("jit(step)/optimizer/add") == "optimizer"
  assert c("jit(step)/embedding/gather") == "embedding"
  assert c("jit(step)/broadcast_in_dim") == "other"
  text = ('%fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, calls=%f, '
          'metadata={op_name="jit(step)/jvp(zebra_lstm_0)/tanh" '
          'source_file="x.py"}\n'
          '  %dot.1 = f32[8]{0} dot(%a, %b), metadata={op_name='
          '"jit(step)/optimizer/mul"}')
  assert traces.hlo_op_scopes(text) == {
      "fusion.3": "jit(step)/jvp(zebra_lstm_0)/tanh",
      "dot.1": "jit(step)/optimizer/mul"}
