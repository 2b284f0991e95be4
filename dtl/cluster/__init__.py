"""A small cluster on one machine: hosts that are network namespaces, each with its own hostname,
address and hosts file, joined by one bridge; Slurm's daemons on them; two-host launches.

    python -m dtl.cluster up 2          node0 (10.77.0.1) and node1 (10.77.0.2)
    python -m dtl.cluster exec node1 hostname -i
    python -m dtl.cluster down          everything `up` made, by the names and pids it recorded

It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN: namespaces, links, mounts). What a real cluster
adds, this one cannot show: InfiniBand and RoCE, GPUDirect, a real shared file system's latency.
"""
