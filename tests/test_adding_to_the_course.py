"""docs/contributing.md's "Adding to the course", held to its word: each path names the files an
addition touches, and each check below lists what an addition left out, so that it fails on a
planted addition that skips one (a strategy with no row in the notes, a schedule built without
its placement, a precision no engine declares)."""

from __future__ import annotations

import os
import re

import pytest

from day20_pp.placement import Schedule
from day20_pp.schedules import SCHEDULES, ScheduleKind, every_schedule
from day22_megatron.ep import EP_AXES
from day22_megatron.stack import build_stack
from day28_gpt125m.strategies import REGISTRY
from day28_gpt125m.strategy import Strategy
from dtl.grid import AXES, ParallelGrid
from dtl.model import GPT, preset
from dtl.reduction import gpt_reductions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*path: str) -> str:
    return open(os.path.join(ROOT, *path)).read()


# --- a strategy: a class in REGISTRY, a row in the day's table and in fit.py's docstring --------


def strategies_missing_a_row(names) -> list[str]:
    """The strategies with no row in day 28's strategy table or no line in fit.py's docstring."""
    notes = _read("day28_gpt125m", "README.md")
    table = set(re.findall(r"^\| `(\w+)` \|", notes, flags=re.M))
    fit_doc = _read("day28_gpt125m", "fit.py").split('"""')[1]
    in_fit = set(re.findall(r"^    (\w+)[ ,]", fit_doc, flags=re.M))
    return [n for n in names if n not in table or n not in in_fit]


def test_every_strategy_has_its_row_in_the_notes_and_in_fit():
    assert strategies_missing_a_row(REGISTRY) == []


def test_a_strategy_registered_without_its_rows_is_caught():
    class Planted(Strategy):
        name = "planted"

    assert strategies_missing_a_row([*REGISTRY, Planted.name]) == ["planted"]


# --- a schedule: an entry in SCHEDULES whose builder states its placement -----------------------


def schedule_problems(kinds: dict[str, ScheduleKind], p: int = 2, m: int = 4) -> list[str]:
    """What each schedule's builder left out: a Schedule carrying its Placement, with every
    stage on one rank and every action's chunk one its rank holds."""
    problems = []
    for name, kind in kinds.items():
        v = 2 if kind.takes_v else 1
        built = kind.build(p, m, v) if kind.takes_v else kind.build(p, m)
        if not isinstance(built, Schedule):
            problems.append(f"{name}: built without its placement")
            continue
        place = built.placement
        stages = sorted(place.stage(r, c) for r in range(place.p) for c in range(place.v))
        if place.p != len(built) or stages != list(range(place.n_stages)):
            problems.append(f"{name}: its placement is not one stage per (rank, chunk)")
        chunks = {a.chunk for acts in built for a in acts}
        if not chunks <= set(range(place.v)):
            problems.append(f"{name}: an action names a chunk its rank does not hold")
    return problems


def test_every_schedule_states_its_placement():
    assert [name for name, _ in every_schedule()] == list(SCHEDULES)
    assert schedule_problems(SCHEDULES) == []


def test_a_schedule_built_without_its_placement_is_caught():
    def bare(p: int, m: int) -> list:
        return [list(acts) for acts in SCHEDULES["1f1b"].build(p, m)]  # a plain list of lists

    planted = {**SCHEDULES, "bare": ScheduleKind(bare, SCHEDULES["1f1b"].bubble)}
    assert schedule_problems(planted) == ["bare: built without its placement"]


# --- a parallel dimension: a grid axis, given a role in every parameter's reduction record ------


def test_every_axis_of_the_grid_has_a_role_for_every_parameter():
    table = gpt_reductions(GPT(preset("tiny")))
    assert table.unplaced(AXES) == []


def test_an_axis_added_to_the_grid_but_not_to_the_reduction_table_is_caught():
    # "fs": a sharded-data axis the table has not been told about
    grid = ParallelGrid(dp=2, fs=2, axes=("pp", "dp", "fs", "cp", "tp"), world_size=4, rank=0)
    table = gpt_reductions(GPT(preset("tiny")), grid.axes)
    live = [a for a in grid.axes if grid.group_size(a) > 1]
    assert live == ["dp", "fs"] and table.unplaced(live) == ["fs"]
    placed = table
    for name in table:  # the table would say, per parameter, what the new axis is to it
        placed = placed.replace(name, shard=(*table[name].shard, "fs"))
    assert placed.unplaced(live) == []
    with pytest.raises(ValueError, match=r"gives the grid axis \['fs'\] no role"):
        build_stack(preset("tiny"), grid, micro_batch_size=1, microbatches=2, seq_len=16)


def test_an_ep_axis_is_placed_for_every_parameter_of_an_moe():
    table = gpt_reductions(GPT(preset("tiny-moe")), EP_AXES)
    assert table.unplaced(EP_AXES) == []
    assert table["blocks.0.mlp.experts.1.c_fc.weight"].routed == ("ep",)  # other experts
    assert table["blocks.0.mlp.router.weight"].average == ("dp", "cp", "ep")  # other tokens


# --- a precision: a row, declared by the engines that train in it -------------------------------
# tests/test_dtl_precision_engines.py: test_every_row_of_the_table_is_declared_by_an_engine, and
# its planted row (no engine declares it: caught, and refused by every engine and config).


@pytest.mark.parametrize(
    "path",
    [
        "dtl/precision.py",
        "dtl/deepspeed.py",
        "day20_pp/placement.py",
        "day20_pp/schedules.py",
        "day28_gpt125m/strategies.py",
        "dtl/grid.py",
        "dtl/reduction.py",
        "day22_megatron/stack.py",
    ],
)
def test_every_file_the_paths_name_exists(path):
    assert f"`{path}`" in _read("docs", "contributing.md"), path
    assert os.path.isfile(os.path.join(ROOT, path)), path
