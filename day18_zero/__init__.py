"""Day 18: ZeRO stages 1-3 by hand and with DeepSpeed."""
