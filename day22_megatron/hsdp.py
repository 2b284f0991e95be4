"""Day 22: HSDP, FSDP2 on a 2-D mesh: sharded inside a group of s ranks, replicated over r groups.

FSDP2 over all N ranks (day 18) keeps 1/N of every parameter, gradient and Adam moment, and all
its traffic, three passes over the parameters per step, runs over all N ranks: past one node,
over the slow network. HSDP (hybrid sharding, torchtitan's `dp_replicate` x `dp_shard`) lays the
ranks out as a (replicate r, shard s) grid, s the GPUs of a node: each parameter is sharded over
its node's s ranks, and the r nodes hold the same shards.

    per rank, per step, Ψ' = the parameters padded as FSDP2 pads (dim 0 to a multiple of s), e bytes
    state           16 Ψ'/s  (fp32: 4 param + 4 grad + 8 Adam)      FSDP over N: 16 Ψ'/N
    shard axis      all-gather (forward) + all-gather (backward) + reduce-scatter, each
                    (s-1)/s Ψ' e, less one all-gather of the root's own parameters (the
                    embeddings, ln_f: FSDP2 keeps the root gathered from forward to backward)
    replicate axis  all-reduce of my gradient shard: 2 (r-1)/r Ψ'/s e    across the nodes

The gradient of a step is reduce-scattered inside the node, then each shard all-reduced with
the same shard on the other nodes (FSDP2 does both in its post-backward): the average over all
N ranks. What crosses the network per rank falls from about 3 Ψ' e (FSDP over N) to 2 Ψ'/s e,
and the state grows from 16 Ψ'/N to 16 Ψ'/s: HSDP pays when 16 Ψ'/s fits beside the
activations (hsdp_scale.py prints the trade at 64 to 1,024 ranks).

    mesh = hsdp_mesh(replicas=2, device_type="cpu")  # DeviceMesh (replicate 2, shard N/2)
    model = apply_hsdp(gpt, mesh)                    # fully_shard per block, then the root
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from dtl.flat import padded_size

REPLICATE, SHARD = "replicate", "shard"  # the mesh's dims, outer to inner (torchtitan's order)
HSDP_AXES = (REPLICATE, SHARD)
ADAM_FP32 = 4 + 4 + 8  # bytes per parameter: fp32 weight, gradient, Adam m and v


def check_replicas(replicas: int, world: int) -> None:
    """ValueError (one line) unless `replicas` splits `world` ranks into equal shard groups."""
    if replicas < 1 or world % replicas:
        raise ValueError(
            f"--replicas={replicas} does not split {world} ranks into equal shard groups"
        )


def hsdp_mesh(replicas: int, device_type: str) -> DeviceMesh:
    """The world's ranks as a (replicate, shard) DeviceMesh: shard groups of world / replicas
    consecutive ranks (one node each, when replicas is the node count). FSDP2 given a 2-D mesh
    replicates over dim 0 and shards over dim 1: HSDP. Collective: the mesh builds its groups."""
    world = dist.get_world_size()
    check_replicas(replicas, world)
    shard = world // replicas
    ranks = [[g * shard + i for i in range(shard)] for g in range(replicas)]  # a rank table
    return DeviceMesh(device_type, ranks, mesh_dim_names=HSDP_AXES)


def apply_hsdp(gpt: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """fully_shard on every block (each its own all-gather unit), then on the root, over the
    2-D mesh: each parameter a DTensor (Replicate over `replicate`, Shard(0) over `shard`)."""
    for block in gpt.blocks.values():  # type: ignore[union-attr, operator]
        fully_shard(block, mesh=mesh)
    return fully_shard(gpt, mesh=mesh)


def padded_numel(shapes: list[torch.Size], shard: int) -> int:
    """Ψ': FSDP2 cuts each parameter on dim 0 into `shard` equal slices, dim 0 padded up."""
    return sum(padded_size(s[0], shard) * (s.numel() // s[0]) for s in shapes)


def padded_counts(gpt: torch.nn.Module, shard: int) -> tuple[int, int]:
    """(Ψ' of the whole GPT, Ψ' of its root's own parameters): what the formulas take."""
    every = [p.shape for p in gpt.parameters()]
    return padded_numel(every, shard), padded_numel(root_shapes(gpt), shard)


def state_bytes(padded: int, shard: int) -> float:
    """What a rank holds between steps: its 1/s of every parameter, gradient and Adam moment."""
    return ADAM_FP32 * padded / shard


def comm_bytes(padded: int, root: int, replicas: int, shard: int, e: int = 4) -> dict[str, float]:
    """Ring bytes one rank sends per step (one micro-batch) on each axis; `root`: the padded
    parameters of the root's own unit (not in a block), gathered once, not twice."""
    r, s = replicas, shard
    return {
        # 2 all-gathers of the blocks, 1 of the root, 1 reduce-scatter of everything
        SHARD: (s - 1) / s * (3 * padded - root) * e,
        REPLICATE: 2 * (r - 1) / r * padded / s * e,  # all-reduce of my Ψ'/s gradient shard
    }


def root_shapes(gpt: torch.nn.Module) -> list[torch.Size]:
    """The shapes of the parameters outside every block: the root unit's own (a tied one once)."""
    in_blocks = {id(p) for p in gpt.blocks.parameters()}  # type: ignore[union-attr]
    return [p.shape for p in gpt.parameters() if id(p) not in in_blocks]
