"""Ray Tune sweeps over raytrain training runs (`raytrain tune`): every trial is a real Train + DeepSpeed run.

spec.py: the sweep config; space.py: search spaces and the adaptive micro-batch searcher;
memory_estimate.py: the per-worker memory estimate; trial.py: one trial; results.py: tables, plot, best config;
run.py: the driver (Tuner, concurrency, resume).
"""
