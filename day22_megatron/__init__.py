"""Day 22: megatron-core end to end, and our own 4-D stack (TP, CP, PP, DP) checked against it."""
