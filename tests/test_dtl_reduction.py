"""dtl.reduction: the table of each parameter's grid axes (averaged, replicated, sharded, staged),
built from the TP plan, the pipeline and the tie, and the groups the stack reads off it. No
process group: the stack's own check against one process is tests/test_day22_reduction.py."""

import pytest

from dtl.model import GPT, preset
from dtl.reduction import Reduction, gpt_reductions


def test_the_gpt_table_names_each_parameters_axes():
    table = gpt_reductions(GPT(preset("tiny")))
    ln = table["blocks.0.ln_1.weight"]  # a LayerNorm: whole on every TP rank
    assert (ln.average, ln.replica, ln.shard, ln.stage) == (("dp", "cp"), ("tp",), (), ("pp",))
    assert table["blocks.0.attn.c_attn.weight"].shard == ("tp",)  # column-parallel: rows cut
    assert table["blocks.0.attn.c_attn.bias"].shard == ("tp",)  # cut with its rows
    assert table["blocks.1.mlp.c_proj.weight"].shard == ("tp",)  # row-parallel: columns cut
    assert table["blocks.1.mlp.c_proj.bias"].replica == ("tp",)  # added once, after the sum
    assert table["wpe.weight"].replica == ("tp",)
    assert table["wte.weight"] == Reduction(average=("dp", "cp"), shard=("tp",), stage=("pp",))
    assert table["lm_head.weight"].copy_of == "wte.weight"  # tied: wte stands for it
    assert table.copies() == {"lm_head.weight": "wte.weight"}
    assert table.average_axes == (("dp", "cp"),)
    assert table.norm_axes == ("tp", "pp")  # Megatron's model-parallel group
    untied = gpt_reductions(GPT(preset("tiny", tie_weights=False)))
    assert untied["lm_head.weight"].copy_of is None and not untied.copies()


def test_average_groups_hold_each_parameter_once_under_its_axes():
    gpt = GPT(preset("tiny"))
    named = dict(gpt.named_parameters(remove_duplicate=False))  # wte.weight is lm_head.weight
    table = gpt_reductions(gpt)
    groups = table.average_groups(named)
    assert list(groups) == [("dp", "cp")]
    assert [id(p) for p in groups["dp", "cp"]] == [id(p) for p in gpt.parameters()]
    planted = table.replace("blocks.0.ln_1.weight", average=("dp",))
    split = planted.average_groups(named)
    assert [len(ps) for ps in split.values()] == [len(list(gpt.parameters())) - 1, 1]
    [alone] = split[("dp",)]
    assert alone is named["blocks.0.ln_1.weight"]
    assert planted.average_axes == (("dp", "cp"), ("dp",))
    # one tensor under two names averaged over two sets of axes: refused
    with pytest.raises(ValueError, match="lm_head.weight: one parameter averaged over"):
        table.replace("lm_head.weight", average=("dp",)).average_groups(named)


def test_an_axis_in_two_roles_is_refused():
    with pytest.raises(ValueError, match="an axis in two roles"):
        Reduction(average=("dp", "cp"), replica=("tp",), shard=("tp",))
