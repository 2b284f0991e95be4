"""Day 21: sequence and context parallelism."""
