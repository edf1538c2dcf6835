"""GenerationOptions in two layers: the research knobs nested per method, given and read by their flat names as
well, each nested value checked by itself and named by its flag; the CLI's option flags made from the same
definitions, research flags under their own heading."""

from __future__ import annotations

import dataclasses

import pytest

from vegas_jax import generate
from vegas_jax.cli import option_flags
from vegas_jax.inputs import InputError
from vegas_jax.runtime.options import DEFAULTS, FLAT_RESEARCH, GenerationOptions
from vegas_jax.runtime.research_options import QuestConfig, SelectionConfig, TreeConfig


def test_flat_keywords_land_in_their_nested_values():
    options = GenerationOptions(method="vegas", sparse_ratio=0.5, min_sparse_tokens=4, draft_tree="4x2")
    assert options.selection == SelectionConfig(sparse_ratio=0.5, min_sparse_tokens=4)
    assert options.drafting == TreeConfig(draft_tree="4x2")
    assert (options.sparse_ratio, options.draft_tree, options.drafter) == (0.5, "4x2", "self")
    # dataclasses.replace takes them too, and a flat knob replaces that field of the nested value given beside it.
    quest = dataclasses.replace(options, method="quest", quest_page=32, draft_tree=None)
    assert quest.quest == QuestConfig(page=32) and quest.selection == options.selection
    assert GenerationOptions(**options.flat()) == options
    assert hash(options) == hash(GenerationOptions(**options.flat()))


def test_plain_decoding_drops_what_only_drafts_use():
    """--compare-ar's run: a baseline's knob, refused with method ar, goes with the drafts."""
    options = GenerationOptions.check(GenerationOptions(method="quest", quest_page=32, sparse_ratio=0.5))
    plain = GenerationOptions.check(options.plain())
    assert (plain.method, plain.quest, plain.effective_gamma) == ("ar", QuestConfig(), 0)


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="sparse_ration"):
        GenerationOptions(sparse_ration=0.5)


@pytest.mark.parametrize("options, name, text", [
    (GenerationOptions(quest_page=3, method="quest"), "quest_page", "quest_page must divide 128, got 3"),
    (GenerationOptions(sparse_ratio="0.5", method="vegas"), "sparse_ratio", "sparse_ratio"),
    (GenerationOptions(method="vegas", quest_page=32), "quest_page", "quest_page 32 applies to method quest only"),
    (GenerationOptions(selection={"sparse_ratio": 0.5}), "selection", "selection must be a SelectionConfig"),
    (GenerationOptions(gamma_costs=(1.0,)), "gamma_costs", "gamma_costs: only with gamma auto"),
])
def test_nested_values_are_checked_and_named_by_their_flat_names(options, name, text):
    with pytest.raises(InputError) as error:
        GenerationOptions.check(options)
    assert error.value.names[0] == name and text in str(error.value)


def test_every_option_has_one_flag_in_its_group():
    parser = generate.build_parser()
    groups = {group.title: {a.dest for a in group._group_actions} for group in parser._action_groups}
    assert groups[option_flags.RESEARCH_HEADING] == set(FLAT_RESEARCH)
    assert groups[option_flags.USER_HEADING] == set(DEFAULTS) - set(FLAT_RESEARCH)
    args = parser.parse_args(["--method", "quest", "--quest-page", "32", "--stop", "x", "--gamma", "auto"])
    options = option_flags.build_options(args)
    assert (options.quest.page, options.stop, options.gamma) == (32, ["x"], "auto")
    defaults = option_flags.build_options(parser.parse_args([]))
    assert GenerationOptions.check(defaults) == GenerationOptions()
