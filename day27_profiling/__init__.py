"""Day 27: profiling and MFU."""
