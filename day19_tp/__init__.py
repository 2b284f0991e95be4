"""Day 19: tensor parallelism by hand (Megatron column/row layers, vocab-parallel)."""
