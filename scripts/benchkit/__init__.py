"""The benchmark suite behind scripts/bench.py: each part measures raytrain beside a plain baseline in the same run."""
