"""Day 16: how NCCL all-reduces. Ring, tree and double binary tree built from send/recv, an
alpha-beta cost model fitted to measurement, an nccl-tests-style benchmark, NCCL log forensics."""
