"""Day 17: DataParallel vs DDP; gradient sync by hand (naive, overlapped, bucketed), no_sync."""
