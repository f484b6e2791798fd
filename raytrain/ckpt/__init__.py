"""Checkpoints: their names (layout), counters (state), catalogue, saving (writer) and restoring."""
