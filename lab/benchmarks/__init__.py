"""What the lab's scripts run: shapes, FLOP counts, timed steps, the torch
reference, traces, memory, the GPU report's stages, the stripes experiment's
report, generation timing and HLO collective counting.

They time the package's own steps (training/loop.py, inference/).
"""
