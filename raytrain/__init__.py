"""raytrain: train transformer LMs on elastic Ray clusters with DeepSpeed, resuming exactly."""

__version__ = "0.1.0"
