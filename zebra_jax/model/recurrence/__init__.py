"""A ZebraLSTM layer's time loops, one backend per module, the same math:
`scan` (lax.scan, the reference, on every backend), `pallas` (fused GPU
kernels, a stripe's window each), `pallas_stream` (the scan's loop, each
step one GPU kernel tiled over the hidden units: any width) and `native`
(compiled C++ from `native.cc`, for CPUs);
`model.recurrence` picks one, or `auto` (the default): native where its
loops run (CPUs, float32), else the scan (`native.chosen`).
"""
