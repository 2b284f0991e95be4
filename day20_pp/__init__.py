"""Day 20: pipeline parallelism by hand (GPipe, 1F1B, interleaved, zero-bubble)."""
