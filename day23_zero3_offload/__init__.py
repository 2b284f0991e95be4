"""Day 23: ZeRO-3 with its state offloaded to CPU memory and NVMe: templates, explainer, costs."""
