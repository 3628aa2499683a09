"""A ZebraLSTM layer's time loops, one backend per module, the same math:
`scan` (lax.scan, the reference and default), `pallas` (fused GPU kernels)
and `native` (compiled C++ from `native.cc`, for CPUs); `model.recurrence`
picks one.
"""
