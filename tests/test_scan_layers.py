"""The decoder's two layer loops (models.decoder.forward's scan_layers: one scanned body over the stacked layers, or
the layers unrolled, VEGAS_SCAN_LAYERS) compute the same thing: the same logits, cache and per-layer aux from one
pass of each attention the loops run, and the same tokens from the engine's Vegas loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import NSA_VIEW_LAYOUT
from models.decoder import forward, layer_specific
from vegas_jax.attention.family import family_of
from vegas_jax.attention.sparse_draft import SparseDraftAttention
from vegas_jax.attention.verify import ScoreRequest, VerifyAttention
from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine

LAYERS = 3  # more than two, so that the scan's carry passes a layer's cache on to a middle layer


def both_loops(engine, attention, config=None, tokens=6):
    """forward's (logits, cache, aux) with the layers scanned and unrolled, from the same fresh cache."""
    config = config or engine.config
    batch = 2
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, tokens)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))

    def run(scan_layers):
        cache = family_of(config).create_cache(config, batch, 64, jnp.float32)
        return jax.jit(lambda p, c: forward(p, ids, positions, c, attention, config=config,
                                            scan_layers=scan_layers))(engine.model.params, cache)

    return run(True), run(False)


def assert_same(scanned, unrolled):
    """Equal to float32 rounding: the scanned and unrolled layers are two XLA programs whose fusions order sums
    differently (CI once saw 1.4e-6 on a value of 0.14)."""
    assert jax.tree.structure(scanned) == jax.tree.structure(unrolled)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(layers=LAYERS)


@pytest.mark.parametrize("request_", [None, ScoreRequest("logit"), ScoreRequest("weight", "each")])
def test_verification_pass_is_the_same_in_both_loops(engine, request_):
    attention = VerifyAttention(request_, LAYERS)
    assert not layer_specific(attention)
    scanned, unrolled = both_loops(engine, attention)
    assert_same(scanned, unrolled)
    if request_ is not None:  # one score array per layer, as the selection policies take them
        assert len(scanned[2]) == LAYERS and all(s.shape[-1] == 64 for s in scanned[2])


def test_last_layer_scores_run_unrolled_and_are_the_same(engine):
    attention = VerifyAttention(ScoreRequest("weight", "each", last_layer_only=True), LAYERS)
    assert layer_specific(attention)
    scanned, unrolled = both_loops(engine, attention)
    assert_same(scanned, unrolled)
    assert [a is None for a in scanned[2]] == [True] * (LAYERS - 1) + [False]


def test_sparse_draft_pass_reads_each_layers_selection_in_both_loops(engine):
    """Each layer attends its own selected rows (indices differ by layer): a scanned body reading another layer's
    selection would differ from the unrolled layers."""
    rng = np.random.default_rng(1)
    indices = jnp.asarray(np.sort(rng.choice(5, size=(LAYERS, 2, 3), replace=True), axis=-1), jnp.int32)
    counts = jnp.asarray(rng.integers(1, 4, (LAYERS, 2)), jnp.int32)
    attention = SparseDraftAttention(indices, counts, jnp.asarray([5, 5], jnp.int32))
    prefilled = both_loops(engine, VerifyAttention(None, LAYERS), tokens=5)[0][1]  # rows 0-4 of every layer
    ids = jnp.asarray([[7], [9]], jnp.int32)
    positions = jnp.asarray([[5], [5]], jnp.int32)
    scanned, unrolled = (forward(engine.model.params, ids, positions, prefilled, attention, config=engine.config,
                                 scan_layers=s) for s in (True, False))
    assert_same(scanned, unrolled)


def test_nsa_view_pass_is_the_same_in_both_loops(engine):
    config = dataclasses.replace(engine.config, attention="nsa-view", nsa=NSA_VIEW_LAYOUT)
    attention = family_of(config).full_attention(config, engine.placement)
    scanned, unrolled = both_loops(engine, attention, config, tokens=20)
    assert_same(scanned, unrolled)


# Vegas (verification and sparse draft attention), a draft tree (tree attention), Quest (its draft attention bounds
# pages of the layer it serves, reading the stacked cache).
@pytest.mark.parametrize("fields", [dict(method="vegas"), dict(method="vegas", gamma=2, draft_tree="2x2"),
                                    dict(method="quest")], ids=["vegas", "vegas-tree", "quest"])
def test_decode_loop_emits_the_same_tokens_in_both_loops(engine, monkeypatch, fields):
    batch = prompts([45, 12, 80], engine.config.vocab_size)
    options = dataclasses.replace(GREEDY, max_new_tokens=48, **fields)
    scanned = engine.generate(batch, options)
    monkeypatch.setenv("VEGAS_SCAN_LAYERS", "0")
    assert not engine.placement.scan_layers
    unrolled = engine.generate(batch, options)
    assert [r.tokens for r in scanned.requests] == [r.tokens for r in unrolled.requests]
    assert scanned.metrics["tau"] == unrolled.metrics["tau"]


def test_the_scan_slices_a_layers_vectors_as_one_array():
    """pack_vectors: the per-layer vectors ([L, n], the norms' scales) of a dtype become one scanned array, and each
    layer's slice of it unpacks to that layer's vectors; matrices, other dtypes, a lone vector and None pass as
    they are."""
    from models.decoder import pack_vectors

    rng = np.random.default_rng(0)
    norm_a, norm_b = jnp.asarray(rng.standard_normal((LAYERS, 5)), jnp.bfloat16), jnp.ones((LAYERS, 7), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((LAYERS, 4, 3)), jnp.bfloat16)
    lone = jnp.asarray(rng.standard_normal((LAYERS, 2)), jnp.float32)
    leaves = [norm_a, weight, None, lone, norm_b]
    scanned, unpack = pack_vectors(leaves)
    assert len(scanned) == 6 and all(got is want for got, want in zip(scanned, [None, weight, None, lone, None]))
    assert scanned[5].shape == (LAYERS, 12)
    for i in range(LAYERS):
        layer = unpack([None if x is None else x[i] for x in scanned])
        for got, want in zip(layer, leaves):
            assert (got is None) == (want is None)
            if want is not None:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want[i]))
