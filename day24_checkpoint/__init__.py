"""Day 24: distributed checkpointing."""
