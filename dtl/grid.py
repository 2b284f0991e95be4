"""The parallel grid: which rank holds which coordinates along the grid's axes (pp, dp, cp, tp by
default), and the process groups along each axis and their combinations (dtl.dist starts the
processes; this lays them out).

    grid = ParallelGrid(tp=2, pp=2)           # dp = world / (pp·cp·tp)
    grid.tp_group, grid.dp_rank, grid.group("dp", "cp"), grid.next_rank

The axes are data: one ordered tuple of names (outermost first) and a size for each. Everything
else (the rank table, the groups, `<axis>_rank`, `<axis>_size`, `<axis>_group`, the DeviceMesh)
is read off that tuple, so another axis is one declaration:

    ParallelGrid(dp=2, tp=2, ep=2, axes=("pp", "dp", "ep", "cp", "tp"))   # grid.ep_group ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Megatron's default rank order "tp-cp-dp-pp" (parallel_state's `order`, with expert parallelism
# 1): TP innermost, so a TP group shares a node's fast links; PP outermost.

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost
PIPELINE = "pp"  # the axis whose ranks are pipeline stages: neighbours, first and last stage
# groups over several axes that the days need, built with the single-axis ones (where the grid
# has the axes):
#   dp x cp  gradients are averaged over every rank that saw other tokens (CP ranks did too)
#   tp x pp  Megatron's "model parallel" group: the gradient norm sums over every shard
DEFAULT_COMBOS = (("dp", "cp"), ("tp", "pp"))


def _pipeline_ends(pp_ranks: list[int]) -> list[int]:
    """The first and last stage of a pipeline group: one rank when there is one stage."""
    return sorted({pp_ranks[0], pp_ranks[-1]})


def _sizes(axes: tuple[str, ...], given: dict[str, int]) -> dict[str, int]:
    """Each axis's size, validated, in the order given (an axis not given: 1). A size for an
    axis the grid does not have is an error unless it is 1 (dp, pp, cp, tp default to 1)."""
    for axis, size in given.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"ParallelGrid: {axis} must be a positive integer, got {size!r}")
    if not axes or len(set(axes)) != len(axes):
        raise ValueError(f"ParallelGrid: axes {axes!r} must name each axis once")
    stray = [a for a, s in given.items() if a not in axes and s != 1]
    if stray:
        raise ValueError(
            f"ParallelGrid: {', '.join(stray)} given a size but not among the axes {axes!r}; "
            "add it to axes=(...)"
        )
    sizes = {a: s for a, s in given.items() if a in axes}
    return sizes | {a: 1 for a in axes if a not in sizes}


class ParallelGrid:
    """Rank <-> coordinates along `axes`, and process groups along axes and their combinations.

    Rank r sits at `torch.arange(world).view(pp, dp, cp, tp)[p, d, c, t] == r` (the sizes in
    the order of `axes`): consecutive ranks differ in tp first, then cp, then dp, then pp.
    Megatron's own example, 16 GPUs, tp=2 pp=4 (so dp=2): tp groups [0,1] [2,3] ...; dp groups
    [0,2] [1,3] [4,6] ...; pp groups [0,4,8,12] [1,5,9,13] ... (megatron/core/parallel_state.py,
    initialize_model_parallel).

        grid = ParallelGrid(dp=2, tp=2)          # keyword-only sizes; their product = world size
        grid.tp_rank, grid.tp_size, grid.tp_group
        grid.group("dp", "cp")                   # any built combination, in any order
        grid.next_rank, grid.prev_rank           # pp neighbours (global ranks, wrapping around)
        grid.embedding_group                     # first + last pp stage: tied wte / lm_head grads
        grid.device_mesh()                       # the same ranks as a DeviceMesh, dims = axes

    `axes` names the dimensions outermost first; a size for another axis is a keyword of the
    same name (ep=2 with "ep" in axes). Creating a group is collective (every rank creates
    every group, in the same order), so the groups are built once, here: each axis,
    `DEFAULT_COMBOS`, the `combos` you pass, and the embedding group. Asking for another
    combination is a one-line error that says how to add it.
    """

    def __init__(
        self,
        *,
        dp: int = 1,
        pp: int = 1,
        cp: int = 1,
        tp: int = 1,
        axes: Sequence[str] = AXES,
        world_size: int | None = None,
        rank: int | None = None,
        build_groups: bool | None = None,
        combos: Iterable[Sequence[str]] = (),
        **more: int,
    ) -> None:
        self.axes = tuple(axes)
        self.sizes = _sizes(self.axes, {"dp": dp, "pp": pp, "cp": cp, "tp": tp, **more})
        initialized = dist.is_initialized()
        world_size = (
            world_size if world_size is not None else (dist.get_world_size() if initialized else 1)
        )
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        product = math.prod(self.sizes.values())
        if product != world_size:
            names, values = "*".join(self.sizes), "*".join(map(str, self.sizes.values()))
            raise ValueError(
                f"ParallelGrid: {names} = {values} = {product} does not match world size "
                f"{world_size}"
            )
        self.world_size = world_size
        shape = [self.sizes[a] for a in self.axes]  # one dimension per axis, outermost first
        self.ranks = torch.arange(world_size).view(*shape)  # host: a rank table
        where = (self.ranks == self.rank).nonzero()[0].tolist()
        self.coords: dict[str, int] = dict(zip(self.axes, where))
        self.combos: list[tuple[str, ...]] = [(a,) for a in self.axes]
        present = [c for c in DEFAULT_COMBOS if set(c) <= set(self.axes)]
        for combo in (*present, *combos):
            if self._key(combo) not in self.combos:
                self.combos.append(self._key(combo))
        self.groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self.embedding_group: dist.ProcessGroup | None = None
        if build_groups if build_groups is not None else initialized:
            self._build_groups()

    def _key(self, axes: Sequence[str]) -> tuple[str, ...]:
        """Axes in the grid's order (outer to inner), validated: ("tp", "dp") -> ("dp", "tp")."""
        unknown = [a for a in axes if a not in self.axes]
        if unknown or not axes or len(set(axes)) != len(axes):
            raise ValueError(
                f"ParallelGrid: bad axes {axes!r}; use distinct names from {self.axes}"
            )
        return tuple(a for a in self.axes if a in axes)

    # --- rank lists (pure: no process group needed) ---------------------------------------------
    def group_size(self, *axes: str) -> int:
        """How many ranks a group spanning `axes` holds (1 for no axis)."""
        return math.prod(self.sizes[a] for a in self._key(axes)) if axes else 1

    def group_ranks(self, *axes: str) -> list[list[int]]:
        """Every group spanning `axes`, as lists of global ranks (the same on every rank)."""
        key = self._key(axes)
        dims, n = [self.axes.index(a) for a in key], self.ranks.dim()
        # the group's axes moved innermost: each row of the flattened table is one group
        moved = self.ranks.movedim(dims, list(range(n - len(dims), n)))
        return [row.tolist() for row in moved.reshape(-1, self.group_size(*key))]

    def ranks_along(self, *axes: str) -> list[int]:
        """The global ranks in this rank's group spanning `axes`, ascending."""
        return next(g for g in self.group_ranks(*axes) if self.rank in g)

    def embedding_ranks(self) -> list[int]:
        """First and last pipeline stage of this rank's pp group (one rank when pp == 1): the
        ranks holding wte and the tied lm_head, whose gradients must be summed."""
        return _pipeline_ends(self.ranks_along(PIPELINE))

    @property
    def is_first_stage(self) -> bool:
        return self.coords[PIPELINE] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords[PIPELINE] == self.sizes[PIPELINE] - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (the last stage's next is the first)."""
        return self._stage_rank(+1)

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (the first stage's previous is the last)."""
        return self._stage_rank(-1)

    def _stage_rank(self, offset: int) -> int:
        pp_ranks = self.ranks_along(PIPELINE)
        return pp_ranks[(self.coords[PIPELINE] + offset) % len(pp_ranks)]

    # --- process groups -------------------------------------------------------------------------
    def _build_groups(self) -> None:
        # new_group is collective: every rank creates every group, in the same order, keeps its own.
        for key in self.combos:
            for ranks in self.group_ranks(*key):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[key] = group
        for pp_ranks in self.group_ranks(PIPELINE):  # pp groups are disjoint: one group each
            ranks = _pipeline_ends(pp_ranks)
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.embedding_group = group

    def group(self, *axes: str) -> dist.ProcessGroup:
        """The process group of this rank spanning `axes` (e.g. group("dp", "cp"))."""
        key = self._key(axes)
        if key not in self.groups:
            why = "was not built" if self.groups else "was not built (no process group yet)"
            raise ValueError(
                f"ParallelGrid: the {'x'.join(key)} group {why}; pass "
                f"combos=[{key!r}] to ParallelGrid(...)"
            )
        return self.groups[key]

    def device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The same grid as a torch DeviceMesh with one dim per axis ("pp", "dp", "cp", "tp").

        For DTensor, FSDP2 (fully_shard) and parallelize_module comparisons: mesh["tp"] holds
        exactly the ranks of grid.tp_group. Creating it is collective (it builds its own groups).
        """
        from torch.distributed.device_mesh import DeviceMesh

        device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        return DeviceMesh(device_type, self.ranks, mesh_dim_names=self.axes)

    if TYPE_CHECKING:  # the names __getattr__ answers for the default axes, for mypy
        pp_rank: int
        dp_rank: int
        cp_rank: int
        tp_rank: int
        pp_size: int
        dp_size: int
        cp_size: int
        tp_size: int
        pp_group: dist.ProcessGroup
        dp_group: dist.ProcessGroup
        cp_group: dist.ProcessGroup
        tp_group: dist.ProcessGroup

    def __getattr__(self, name: str) -> int | dist.ProcessGroup:
        # grid.tp_rank, grid.dp_size, grid.pp_group ... read off the tables above, for every
        # axis (read from __dict__: a copy being built has no axes yet)
        axis, _, what = name.partition("_")
        read: dict[str, Callable[[], int | dist.ProcessGroup]] = {
            "rank": lambda: self.coords[axis],
            "size": lambda: self.sizes[axis],
            "group": lambda: self.group(axis),
        }
        if axis in self.__dict__.get("axes", ()) and what in read:
            return read[what]()
        raise AttributeError(name)

    def __str__(self) -> str:
        sizes = "-".join(f"{a.upper()}({self.sizes[a]})" for a in reversed(self.axes))
        coords = ", ".join(f"{a}={self.coords[a]}" for a in self.axes)
        return f"{sizes} rank {self.rank}: {coords}"
