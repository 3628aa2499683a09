"""What every mode stands on: the mesh, multi-process start-up, checkpoints,
the run directory's config, config checks, logs, progress and profiling."""
