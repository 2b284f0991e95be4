"""Reduction groups: for each parameter, the grid axes along which its copies and pieces lie, so
that every collective of a step asks the parameter, never its name.

Each grid axis plays one of four roles for a parameter:

    average   replicas that saw other data (dp, and cp: other tokens of the same rows): the
              gradient is averaged over them (DP's all-reduce)
    replica   copies with the same gradient (tp for a LayerNorm, wpe, a row-parallel bias):
              counted once in the global norm, where this rank's coordinate along them is 0
    shard     ranks hold different pieces of the tensor (tp for a column-parallel weight): the
              squares summed in the norm, the pieces joined for the full tensor
    stage     ranks hold different tensors (pp: each pipeline stage its own layers): the squares
              summed, the stages' tensors merged for the full state
    routed    ranks hold different tensors and send this one their tokens (ep for an expert: the
              all-to-all brings every ep rank's tokens to its owner, so its gradient already
              sums their losses' shares): the average divides by their count too; the squares
              summed and the tensors merged, as for stages

and a parameter may be a `copy_of` another (a tied lm_head on the last stage: the pipeline sums
its gradient into wte's, and the norm and the full state count it under wte).

    table = gpt_reductions(gpt)                  # once, from the TP plan, the stages, the tie
    table["blocks.0.ln_1.weight"]                # average (dp, cp), replica (tp,), stage (pp,)
    table.average_groups(named)                  # axes -> the parameters averaged over them
    table.norm_axes                              # ("tp", "pp"): where the squares are summed

Megatron-core keeps the same facts as attributes on each parameter (`tensor_model_parallel`,
`shared_embedding`, `allreduce=False` on an expert) and its DDP puts expert parameters in their
own buffers, reduced over the expert-data-parallel group: a parameter not replicated over dp x cp
is reduced over the ranks that hold its replicas, and over no others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtl.grid import AXES
from dtl.model import GPT
from dtl.moe import MoE
from dtl.tp_plan import tp_shard_of

DATA = ("dp", "cp")  # the ranks that saw other tokens: every GPT parameter is averaged over them
TENSOR = ("tp",)  # the TP plan's axis: its modules are sharded over it, the rest replicated
PIPELINE = ("pp",)  # each stage holds its own layers
EXPERT = ("ep",)  # expert parallelism: each rank its own experts, every rank's tokens


@dataclass(frozen=True)
class Reduction:
    """How one parameter lies on the grid: the axes of each role (an axis in one role at most)."""

    average: tuple[str, ...] = ()
    replica: tuple[str, ...] = ()
    shard: tuple[str, ...] = ()
    stage: tuple[str, ...] = ()
    routed: tuple[str, ...] = ()
    copy_of: str | None = None  # the parameter this one is a copy of (it stands for both)

    def __post_init__(self) -> None:
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"Reduction: an axis in two roles: {self}")

    @staticmethod
    def roles() -> tuple[str, ...]:
        """The role fields, in declaration order: every field but `copy_of`."""
        return tuple(f.name for f in dataclasses.fields(Reduction) if f.name != "copy_of")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis this record gives a role."""
        return tuple(a for role in self.roles() for a in getattr(self, role))

    def within(self, axes: Iterable[str]) -> Reduction:
        """The record with the axes a grid lacks left out (no ep axis: no expert parallelism)."""
        keep = set(axes)
        changes: dict[str, Any] = {
            r: tuple(a for a in getattr(self, r) if a in keep) for r in self.roles()
        }
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ReductionTable(Mapping[str, Reduction]):
    """name -> Reduction for every parameter of a model (one-process names, tied aliases too)."""

    records: Mapping[str, Reduction]

    def __getitem__(self, name: str) -> Reduction:
        return self.records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def replace(self, name: str, **changes: Any) -> ReductionTable:
        """A table with one record changed (a layer that reshards one parameter, a test)."""
        return ReductionTable({**self.records, name: dataclasses.replace(self[name], **changes)})

    def _union(self, role: str) -> tuple[str, ...]:
        seen = (a for r in self.records.values() for a in getattr(r, role))
        return tuple(dict.fromkeys(seen))

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The axes some parameter is cut into pieces over."""
        return self._union("shard")

    @property
    def stage_axes(self) -> tuple[str, ...]:
        """The axes over which ranks hold different parameters."""
        return self._union("stage")

    @property
    def merge_axes(self) -> tuple[str, ...]:
        """The axes over which ranks hold different tensors (stages, experts): merged by name."""
        return tuple(dict.fromkeys(self.stage_axes + self._union("routed")))

    @property
    def norm_axes(self) -> tuple[str, ...]:
        """Where the global norm's squares are summed: the axes of pieces, of stages, of experts
        and of copies (counted once: at coordinate 0). The averaged replicas (dp, cp) hold the
        same numbers once averaged, so the sum leaves them out."""
        return tuple(dict.fromkeys(self._union("replica") + self.shard_axes + self.merge_axes))

    def divisor_axes(self, average: tuple[str, ...]) -> tuple[str, ...]:
        """What the gradients averaged over `average` are divided by: those axes and the routed
        axes of the parameters averaged over them (one answer, or a one-line error)."""
        routed = {r.routed for r in self.records.values() if r.average == average}
        if len(routed) > 1:
            raise ValueError(f"parameters averaged over {average} are routed over {routed}")
        return average + (routed.pop() if routed else ())

    @property
    def average_axes(self) -> tuple[tuple[str, ...], ...]:
        """Each distinct set of axes some parameter's gradient is averaged over."""
        return tuple(dict.fromkeys(r.average for r in self.records.values()))

    def unplaced(self, axes: Iterable[str]) -> list[str]:
        """The axes of `axes` that some parameter's record gives no role: along them its
        gradient would be neither averaged nor summed, silently (a new grid axis the table has
        not been told about)."""
        return [a for a in axes if any(a not in r.axes for r in self.records.values())]

    def copies(self) -> dict[str, str]:
        """name -> the parameter it is a copy of."""
        return {n: r.copy_of for n, r in self.records.items() if r.copy_of is not None}

    def average_groups(
        self, named: Mapping[str, torch.Tensor]
    ) -> dict[tuple[str, ...], list[torch.Tensor]]:
        """This rank's parameters by the axes their gradients are averaged over, each parameter
        once (a tied one held under two names: both names must agree), in `named`'s order."""
        groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
        axes_of: dict[int, tuple[str, ...]] = {}  # id(parameter) -> its axes: each once
        for name, p in named.items():
            axes = self[name].average
            if id(p) not in axes_of:
                axes_of[id(p)] = axes
                groups.setdefault(axes, []).append(p)
            elif axes_of[id(p)] != axes:
                raise ValueError(f"{name}: one parameter averaged over {axes_of[id(p)]} and {axes}")
        return groups


def expert_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the parameters inside an MoE layer's experts (none in a dense model)."""
    return [
        f"{prefix}.experts.{name}"
        for prefix, layer in model.named_modules()
        if isinstance(layer, MoE)
        for name, _ in layer.experts.named_parameters()
    ]


def gpt_reductions(gpt: GPT, axes: Iterable[str] = AXES) -> ReductionTable:
    """The table for the shared GPT under the course's stack, on a grid of `axes`: averaged over
    dp x cp; sharded over tp where dtl.tp_plan.TP_PLAN splits the module (a row-parallel bias
    excepted: added after the sum, whole on every TP rank), replicated over tp elsewhere; each
    layer on its pipeline stage; a tied lm_head a copy of wte. With an ep axis, an expert is
    routed over it and every other parameter averaged over it too (the ep ranks saw other
    tokens). Names are the one-process model's (`gpt` before a pipeline cuts it or apply_ep
    drops experts; apply_tp keeps them)."""
    records = {}
    experts = set(expert_parameters(gpt))
    for name in dict(gpt.named_parameters(remove_duplicate=False)):
        module_name, _, kind = name.rpartition(".")
        shard = tp_shard_of(module_name)
        cut = shard is not None and not (shard.style == "row" and kind == "bias")
        expert = name in experts
        records[name] = Reduction(
            average=DATA if expert else DATA + EXPERT,
            replica=() if cut else TENSOR,
            shard=TENSOR if cut else (),
            stage=PIPELINE,
            routed=EXPERT if expert else (),
        ).within(axes)
    # tied: lm_head.weight is wte.weight's second name (one stage) or its copy (the last stage)
    if gpt.cfg.tie_weights:
        records["lm_head.weight"] = dataclasses.replace(records["wte.weight"], copy_of="wte.weight")
    return ReductionTable(records)
