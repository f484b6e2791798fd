"""Elastic runs: a worker group that follows the capacity there is, inside scaling.num_workers' [MIN, MAX]."""
