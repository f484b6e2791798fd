"""Checkpoints: their names (layout), counters (state), catalogue, saving (writer), restoring and health rollback."""
