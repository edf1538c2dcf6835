"""SSV in the decode loop (vegas_jax.ssv.choice): precision classes, approximate modes and the planner on a tiny random
3-layer NSA checkpoint (fla format), float32. With an approximate mode, greedy tree speculation equals plain greedy
decoding of that mode's modified target (vegas_jax.attention.nsa_approx.greedy_decode, itself checked against a
float64 transcription of the target in tests/test_nsa_approx.py) token for token on a ragged batch: a mode pinned
by the user (self drafts) and the mode the planner picks from a profile (n-gram drafts); the planner stays in
the user's class and decodes plainly when its profile makes speculation useless; bad precision values and profile
files give one error line naming the flag."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_nsa import TINY_NSA, write_tiny_nsa
from test_planner import profile_doc
from vegas_jax.attention.nsa_approx import greedy_decode
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.loading import load_model
from vegas_jax.ssv.precision import ApproxMode

TINY_3 = {**TINY_NSA, "num_hidden_layers": 3}  # layers 0 and 2 refresh, layer 1 reuses (refresh every 2)
LENGTHS, NEW = [52, 37], 14  # past the 2 selected blocks and the window; the steps cross spans and blocks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_nsa(tmp_path_factory.mktemp("tiny-nsa-3"), TINY_3)


@pytest.fixture(scope="module")
def engine(folder):
    return Engine(load_model(folder, jnp.float32))


@pytest.fixture(scope="module")
def ids():
    rng = np.random.default_rng(7)
    first = rng.integers(3, TINY_3["vocab_size"], LENGTHS[0]).tolist()
    return [first, first[:20] + first[:LENGTHS[1] - 20]]  # a repeated stretch, for n-gram matches


def profile_file(tmp_path, tree_cost: float) -> str:
    path = tmp_path / f"profile-{tree_cost}.json"
    path.write_text(json.dumps(profile_doc(tree_cost)))
    return str(path)


def target_greedy(engine, ids, mode: ApproxMode) -> list[list[int]]:
    """Each prompt's greedy tokens under the mode's target, cut after an EOS (where the engine stops)."""
    out = []
    for p in ids:
        tokens = greedy_decode(engine.model.params, engine.config, np.asarray(p)[None], NEW, mode)[0][0].tolist()
        ends = [i for i, t in enumerate(tokens) if t in engine.tokenizer.eos_ids]
        out.append(tokens[: ends[0] + 1] if ends else tokens)
    return out


def test_greedy_trees_of_a_pinned_approximate_mode_decode_its_modified_target(engine, ids):
    options = GenerationOptions(max_new_tokens=NEW, draft_tree="2x2", precision="approximate", approx_mode="s4w2r2")
    result = engine.generate(ids, options)
    assert [r.tokens for r in result.requests] == target_greedy(engine, ids, ApproxMode(4, 2, 2))
    assert result.metrics["approx_mode"] == "s4w2r2" and result.metrics["ssv_plan"]["source"] == "default"
    assert result.metrics["tau"] > 1.0  # drafts were accepted


def test_the_planners_mode_is_decoded_exactly_and_its_choice_reported(engine, ids, tmp_path):
    """A profile where trees pay: in the approximate class (tolerance 0.05) the planner takes s8w1r1 (measured
    disagreement 0.01; s1w1r4's 0.2 is out of the class) with a tree; the run decodes that target."""
    options = GenerationOptions(max_new_tokens=NEW, drafter="ngram", precision="approximate",
                                ssv_profile=profile_file(tmp_path, 1.0))
    result = engine.generate(ids, options)
    plan = result.metrics["ssv_plan"]
    assert plan["mode"] == "s8w1r1" and plan["tree"] is not None and result.metrics["draft_tree"] == plan["tree"]
    assert [r.tokens for r in result.requests] == target_greedy(engine, ids, ApproxMode(8, 1, 1))
    assert plan["measured_ms_per_token"] > 0 and plan["predicted_ms_per_token"] > 0


def test_the_planner_keeps_the_class_and_decodes_plainly_when_speculation_is_useless(engine, ids, tmp_path):
    """engine.plan: the choice and the loop it would compile, without compiling."""
    useful, useless = profile_file(tmp_path, 1.0), profile_file(tmp_path, 1e3)  # a tree pass 1000x a plain one
    plan = lambda **fields: engine.plan(ids, GenerationOptions(max_new_tokens=NEW, drafter="ngram", **fields))
    exact = plan(ssv_profile=useful)["ssv_plan"]
    assert exact["mode"] == "exact" and exact["tree"] is not None  # the faster modes are out of the exact class
    assert plan(ssv_profile=useful, precision="approximate", precision_tolerance=0.5)["ssv_plan"]["mode"] == "s1w1r4"
    plain = plan(ssv_profile=useless)  # and what the loop compiles for: plain NSA decoding steps
    assert plain["ssv_plan"]["tree"] is None and plain["draft_tree"] is None and plain["gamma"] == 0


def test_a_dense_models_profile_is_refused_for_an_nsa_model(engine, ids, tmp_path):
    from vegas_jax.inputs import InputError

    path = tmp_path / "dense.json"
    path.write_text(json.dumps({**profile_doc(), "config": {"attention": "dense"}}))
    with pytest.raises(InputError, match="dense.json: profiles a dense model, and this one is NSA"):
        engine.plan(ids, GenerationOptions(max_new_tokens=NEW, drafter="ngram", ssv_profile=str(path)))


@pytest.mark.parametrize("flags, needle", [
    (["--precision", "fast"], "error: --precision must be one of exact, approximate, got 'fast'"),
    (["--precision", "approximate", "--precision-tolerance", "0.9"], "error: --precision-tolerance 0.9: must be in"),
    (["--approx-mode", "s4w2r2"], "error: --approx-mode s4w2r2: an approximate mode changes the output"),
    (["--precision", "approximate", "--approx-mode", "s3w1r1"], "share_span 3 must divide the selection block 16"),
    (["--ssv-profile", "MISSING"], "error: --ssv-profile MISSING: No such file or directory"),
    (["--ssv-profile", "BAD"], "error: --ssv-profile BAD: not JSON"),
    (["--ssv-profile", "GOOD", "--draft-tree", "2x2"], "error: --draft-tree 2x2: with --ssv-profile the planner"),
    (["--ssv-profile", "GOOD"], "error: --drafter self: the profile GOOD has no draft times for it (it has: ngram)"),
], ids=["precision", "tolerance", "mode-without-class", "mode-span", "missing", "malformed", "tree-and-profile",
        "drafter"])
def test_bad_precision_values_and_profiles_are_one_line(folder, tmp_path, capsys, flags, needle):
    from vegas_jax import generate

    (tmp_path / "BAD").write_text("{not json")
    profile_file(tmp_path, 1.0)
    (tmp_path / "GOOD").write_text((tmp_path / "profile-1.0.json").read_text())
    flags = [str(tmp_path / f) if f in ("MISSING", "BAD", "GOOD") else f for f in flags]
    needle = needle.replace("MISSING", str(tmp_path / "MISSING")).replace("BAD", str(tmp_path / "BAD")) \
        .replace("GOOD", str(tmp_path / "GOOD"))
    rc = generate.main(["--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--quiet", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_a_dense_model_refuses_the_approximate_class(capsys):
    from pathlib import Path

    from vegas_jax import generate

    tiny_llama = Path(__file__).parent / "fixtures" / "tiny-llama"
    rc = generate.main(["--model", str(tiny_llama), "--prompt", "hi", "--max-new-tokens", "2", "--quiet",
                        "--precision", "approximate"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--precision approximate: precision classes" in err[0], err


def test_the_memory_plan_counts_the_approximate_cache_it_allocates(engine, ids):
    from vegas_jax.attention.nsa_approx import ApproxNSACache

    plan = engine.plan(ids, GenerationOptions(max_new_tokens=NEW, precision="approximate", approx_mode="s4w2r2"))
    cache = jax.eval_shape(lambda: ApproxNSACache.create(engine.config, ApproxMode(4, 2, 2), plan["batch_rows"],
                                                         plan["cache_capacity"], jnp.float32))
    assert plan["bytes_per_device"]["kv_cache"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


@pytest.mark.parametrize("precision, mode", [("exact", None), ("approximate", "s2w1r2")])
def test_the_compiled_tree_loop_updates_the_kv_cache_in_place(engine, ids, precision, mode):
    """No copy of a layer's K or V cache in the compiled SSV loop (XLA's optimized HLO): verification reads the
    cache after writing the nodes' rows into it. Had it read the cache as it came, XLA would copy every layer's K
    and V each iteration (it did: two copies per layer), a read and a write of the whole cache for nothing."""
    options = GenerationOptions(max_new_tokens=NEW, draft_tree="3x2", drafter="self", precision=precision,
                                approx_mode=mode)
    started = engine.start(ids, options)
    cache = started.state.cache
    layer_k = (cache.nsa if hasattr(cache, "nsa") else cache).k[0]
    shape = f"{jnp.dtype(layer_k.dtype).name.replace('float', 'f')}[{','.join(map(str, layer_k.shape))}]"
    copied = re.findall(r"= (\S+) copy\(", started.decode.as_text())  # shapes as XLA spells them: f32[B,T,H,D]
    assert copied and not [c for c in copied if c.startswith(shape)], (shape, sorted(set(copied)))
