"""Benchmark library: shapes, FLOP counts, timed steps, the torch reference,
traces, memory, the GPU report's stages and the stripes experiment's report.

Above training and inference (it times both), below the tools that run it.
"""
