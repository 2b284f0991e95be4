"""The preflight: what a multi-node launch checks on every node before any collective starts.

    python -m dtl.preflight --nnodes=2 --endpoint=node0:29500 --folders=outputs

Run on every node with the endpoint its launch line names (torchrun's --rdzv-endpoint, or
MASTER_ADDR:MASTER_PORT). Each node first checks itself (network.py, checks.py): the endpoint
resolves, and not to this node's loopback; the address gloo would bind is not a loopback one;
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name interfaces that exist, in the syntax their
library takes; on the endpoint's host, the port is free. Then the nodes meet at the endpoint
through a TCPStore (exchange.py), and each compares what every node reported: node ranks,
hostnames, torch and course versions, and whether each of the given folders is the same folder
on every node. Every problem is one line; none prints one line per node and exits 0.
"""
