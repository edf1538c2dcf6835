"""The approximate NSA modes (vegas_jax.ssv.precision.ApproxMode): the fused reuse-layer kernel (interpret mode) equals
its jnp twin and the float64 oracle given injected blocks; the shared selection of V2 equals its definition found
by brute force on chains and trees; plain decoding of each modified target (jnp path, and the kernels for one mode)
equals a float64 numpy transcription of its definition (tests/nsa_approx_reference.py) on a tiny NSA model."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_approx_reference as oracle
from nsa_reference import nsa_rows
from models.config import NSALayout
from models.nsa_cache import NSALayerCache, compressed_rows, write_tokens
from models.nsa_shared_selection import BEFORE_PASS, anchor_rows, chain_sees, shared_blocks
from pallas_kernels.nsa_reuse import nsa_reuse_decode
from pallas_kernels.nsa_verify import ancestor_mask
from test_nsa import TINY_NSA, tiny_nsa_weights, write_tiny_nsa
from vegas_jax.attention.nsa_approx import branches_with_blocks, greedy_decode
from vegas_jax.inputs import InputError
from vegas_jax.loading import load_model
from vegas_jax.ssv.precision import ApproxMode

HEADS, KV_HEADS, DIM = 4, 2, 16
KERNEL_LAYOUT = NSALayout(32, 16, 16, 4, 32, forced_initial=1, forced_local=1)


# ---- the fused reuse-layer kernel ------------------------------------------------------------------------------

def filled_cache(layout, capacity, seed):
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(1, capacity, KV_HEADS, DIM)), jnp.float32) for _ in range(2))
    rows = compressed_rows(layout, capacity)
    empty = NSALayerCache(jnp.zeros_like(k), jnp.zeros_like(v), *(jnp.zeros((1, rows, KV_HEADS, DIM)),) * 2)
    return write_tokens(empty, k, v, jnp.arange(capacity, dtype=jnp.int32)[None], layout), np.asarray(k[0]), \
        np.asarray(v[0])


@pytest.mark.parametrize("kind", ["nsa", "nsa-view"])
def test_fused_reuse_kernel_equals_its_jnp_twin_and_the_float64_oracle(kind):
    """Injected blocks of another layer (6 of them, more than top_n, with a pad and blocks the query's own
    selection would not take) at positions early (few compressed rows) and late (window inside a selected block)."""
    capacity = 256
    cache, k, v = filled_cache(KERNEL_LAYOUT, capacity, seed=3)
    rng = np.random.default_rng(4)
    for position, blocks in [(21, [[0, 1, -1, -1, -1, -1], [1, -1, 0, -1, -1, -1]]),
                             (201, [[12, 0, 3, 9, 11, -1], [2, 5, 7, 12, 1, 10]])]:
        q = rng.normal(size=(1, HEADS, DIM))
        gates = rng.uniform(size=(1, HEADS, 3)) if kind == "nsa" else None
        injected = jnp.asarray([blocks], jnp.int32)
        kernel = nsa_reuse_decode(jnp.asarray(q, jnp.float32), cache.k, cache.v, cache.k_cmp, cache.v_cmp, injected,
                                  jnp.asarray([position]), None if gates is None else jnp.asarray(gates, jnp.float32),
                                  layout=KERNEL_LAYOUT, kind=kind, interpret=True)
        twin = branches_with_blocks(jnp.asarray(q[:, None], jnp.float32), cache, jnp.asarray([[position]]),
                                    None if gates is None else jnp.asarray(gates[:, None], jnp.float32),
                                    injected[:, :, None], KERNEL_LAYOUT, kind)[:, 0]
        q_rows = np.zeros((position + 1, HEADS, DIM))
        q_rows[position] = q[0]
        g_rows = None if gates is None else np.repeat(gates, position + 1, axis=0)
        want = nsa_rows(q_rows, k[:position + 1], v[:position + 1], g_rows, KERNEL_LAYOUT, kind,
                                       [position], lambda t, h: blocks[h])[0]
        np.testing.assert_allclose(np.asarray(kernel[0]), want, atol=2e-5, err_msg=f"kernel at {position}")
        np.testing.assert_allclose(np.asarray(twin[0]), want, atol=2e-5, err_msg=f"jnp twin at {position}")


# ---- V2's shared selection ----------------------------------------------------------------------------------

def brute_force_anchor(positions, sees, span, i):
    """The row i sees at its anchor position, else BEFORE_PASS, by a walk over the rows."""
    anchor = positions[i] - positions[i] % span
    found = [j for j in range(len(positions)) if sees[i][j] and positions[j] == anchor]
    assert len(found) <= 1
    return found[0] if found else BEFORE_PASS


@pytest.mark.parametrize("span", [2, 4, 8])
def test_shared_selection_equals_its_definition_on_chains_and_trees(span):
    """A chain starting mid-span and a random tree whose paths cross a span boundary: each row's selection is
    its anchor row's own selection, or the stored one when the anchor precedes the pass."""
    rng = np.random.default_rng(span)
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, 20)], np.int32)
    tree_sees = np.asarray(ancestor_mask(jnp.asarray(parents)))
    tree_positions = 37 + tree_sees.sum(axis=1) - 1
    chain_positions = np.arange(13, 33)
    for positions, sees in [(chain_positions, np.asarray(chain_sees(jnp.asarray(chain_positions[None])))[0]),
                            (tree_positions, tree_sees)]:
        got = np.asarray(anchor_rows(jnp.asarray(positions[None]), jnp.asarray(sees[None]), span))[0]
        want = [brute_force_anchor(positions, sees, span, i) for i in range(len(positions))]
        np.testing.assert_array_equal(got, want)
        own = rng.integers(0, 9, size=(1, KV_HEADS, len(positions), 3))
        stored = rng.integers(10, 19, size=(1, KV_HEADS, 3))
        shared = np.asarray(shared_blocks(jnp.asarray(own), jnp.asarray(got[None]), jnp.asarray(stored)[:, :, None]))[0]
        for i, a in enumerate(want):
            np.testing.assert_array_equal(shared[:, i], stored[0] if a == BEFORE_PASS else own[0, :, a])
        assert (np.asarray(want) == BEFORE_PASS).any() and (np.asarray(want) >= 0).any()


# ---- tree verification of a modified target ------------------------------------------------------------------

@pytest.mark.parametrize("role", ["refresh", "reuse"])
def test_tree_verification_of_a_modified_target_equals_decoding_each_path(role):
    """One layer of s4w2 (refresh) or with injected blocks (reuse): every node of a random tree whose paths cross a
    span boundary (anchors in the prefix, at the root's children, deeper) against the float64 transcription of
    the target decoding the node's root-to-node path."""
    from pallas_kernels.nsa_verify import nsa_tree_verify
    from vegas_jax.attention.nsa_approx import tree_reselect

    mode, length, nodes, group = ApproxMode(share_span=4, widen=2), 218, 12, HEADS // KV_HEADS
    wide = mode.selection_layout(KERNEL_LAYOUT)
    rng = np.random.default_rng(11 if role == "refresh" else 12)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8, 9], np.int32)
    depth = np.asarray(ancestor_mask(jnp.asarray(parents))).sum(axis=1) - 1
    q, k, v = (rng.normal(size=(length + nodes, h, DIM)) for h in (HEADS, KV_HEADS, KV_HEADS))
    gates = rng.uniform(size=(length + nodes, HEADS, 3))
    capacity, cmp_rows = 256, compressed_rows(KERNEL_LAYOUT, 256)
    zeros = lambda rows: jnp.zeros((1, rows, KV_HEADS, DIM), jnp.float32)
    written = write_tokens(NSALayerCache(zeros(capacity), zeros(capacity), zeros(cmp_rows), zeros(cmp_rows)),
                           jnp.asarray(k[None, :length], jnp.float32), jnp.asarray(v[None, :length], jnp.float32),
                           jnp.arange(length, dtype=jnp.int32)[None], KERNEL_LAYOUT)
    prefix = jax.tree.map(lambda x: x[0], written)  # rows [0, length) and their complete compressed blocks
    stored = np.array([oracle.anchor_selection(q, k, KERNEL_LAYOUT, 4, 2, length - 1, h, group)
                       for h in range(KV_HEADS)])
    injected = rng.integers(-1, 9, size=(nodes, KV_HEADS, wide.top_n))
    t = lambda x: jnp.asarray(x[length:], jnp.float32)
    reselect = tree_reselect(mode, jnp.asarray(stored, jnp.int32),
                             None if role == "refresh" else jnp.asarray(injected, jnp.int32))
    verify = jax.jit(lambda *a: nsa_tree_verify(*a, layout=wide, reselect=reselect))
    got = verify(t(q), prefix, t(k), t(v), t(gates), jnp.int32(length), jnp.asarray(parents))
    for i in range(nodes):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        rows = list(range(length)) + [length + j for j in reversed(path)]
        pq, pk, pv, pg = (x[rows] for x in (q, k, v, gates))
        p = length + depth[i]
        blocks_of = (lambda r, h: oracle.anchor_selection(pq, pk, KERNEL_LAYOUT, 4, 2, r, h, group)) \
            if role == "refresh" else (lambda r, h: injected[i, h])
        want = nsa_rows(pq, pk, pv, pg, KERNEL_LAYOUT, "nsa", [p], blocks_of)[0]
        np.testing.assert_allclose(np.asarray(got[i]), want, atol=2e-5, err_msg=f"node {i} (depth {depth[i]})")


# ---- plain decoding of each modified target ------------------------------------------------------------------

TINY_3 = {**TINY_NSA, "num_hidden_layers": 3}
PROMPT, STEPS = 52, 14  # the steps cross a span boundary of every mode and the selection block at 64
MODES = [ApproxMode(share_span=8), ApproxMode(refresh_every=2), ApproxMode(share_span=4, widen=2, refresh_every=2)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(write_tiny_nsa(tmp_path_factory.mktemp("tiny-nsa-3"), TINY_3), jnp.float32)


# The combined mode runs its decode steps through the fused kernel (interpret; its jnp twin is tested above), the
# others through the jnp path; every prefill is jnp.
@pytest.mark.parametrize("mode, backend", [(MODES[0], "reference"), (MODES[1], "reference"), (MODES[2], "interpret")],
                         ids=lambda x: x.name() if isinstance(x, ApproxMode) else x)
def test_plain_decoding_of_a_modified_target_equals_its_float64_definition(tiny_model, mode, backend):
    """Prefill, then greedy steps (the stored span selection read where an anchor precedes the step); each step's
    logits against the transcription's rows over the whole sequence, which differ from the exact target's."""
    prompt = np.random.default_rng(7).integers(3, TINY_3["vocab_size"], PROMPT)
    tokens, logits = greedy_decode(tiny_model.params, tiny_model.config, prompt[None], STEPS, mode, backend=backend)
    sequence = np.concatenate([prompt, tokens[0]])
    weights, layout = tiny_nsa_weights(TINY_3), tiny_model.config.nsa
    want = oracle.model_logits(weights, TINY_3, layout, sequence[:-1], mode.share_span, mode.widen,
                               mode.refresh_every)[PROMPT - 1:]
    scale = np.abs(want).max()
    np.testing.assert_allclose(logits[0], want, atol=2e-4 * scale)
    exact = oracle.model_logits(weights, TINY_3, layout, sequence[:-1], 1, 1, 1)[PROMPT - 1:]
    assert np.abs(exact - want).max() > 1e-2 * scale  # the mode is a different model: the comparison can fail


def test_a_mode_that_straddles_selection_blocks_is_refused(tiny_model):
    with pytest.raises(InputError, match="share_span 3 must divide the selection block 16"):
        greedy_decode(tiny_model.params, tiny_model.config, np.ones((1, 4), np.int32), 1, ApproxMode(share_span=3))


@pytest.mark.parametrize("kind, heads, kv_heads, top_n", [("nsa-view", 9, 3, 32), ("nsa", 32, 2, 16)],
                         ids=["smollm2-view-widened", "nsa-1b"])
def test_the_fused_reuse_kernel_lowers_to_triton_for_h200(kind, heads, kv_heads, top_n):
    from h200_lowering import lower_for_h200
    from models.config import NSA_1B_LAYOUT, NSA_VIEW_LAYOUT

    layout = NSA_VIEW_LAYOUT if kind == "nsa-view" else NSA_1B_LAYOUT
    batch, capacity, spec = 2, 32768, jax.ShapeDtypeStruct
    cmp_rows = compressed_rows(layout, capacity)
    lowered = lower_for_h200(
        nsa_reuse_decode, spec((batch, heads, 64), jnp.bfloat16),
        *[spec((batch, capacity, kv_heads, 64), jnp.bfloat16)] * 2,
        *[spec((batch, cmp_rows, kv_heads, 64), jnp.bfloat16)] * 2,
        spec((batch, kv_heads, top_n), jnp.int32), spec((batch,), jnp.int32),
        spec((batch, heads, 3), jnp.float32) if kind == "nsa" else None, layout=layout, kind=kind)
    assert "__gpu$xla.gpu.triton" in lowered


@pytest.mark.parametrize("kind", ["nsa", "nsa-view"])
def test_a_reuse_layer_derives_no_selection_in_tree_verification(kind):
    """A reuse layer's tree verification attends its refresh layer's injected blocks, and the compiled program
    keeps none of the derivation: no top-n over selection scores, and on the view (whose output has no compressed
    branch) none of the compressed rows' products either. The refresh layer's program, for contrast, has both."""
    import collections
    import re

    from pallas_kernels.nsa_verify import nsa_tree_verify
    from vegas_jax.attention.nsa_approx import tree_reselect

    mode = ApproxMode.from_name("s1w1r2")
    wide = mode.selection_layout(KERNEL_LAYOUT)
    parents, spec = (-1, 0, 0, 1, 2), jax.ShapeDtypeStruct
    rows, capacity = len(parents), 256
    cache = NSALayerCache(*[spec((capacity, KV_HEADS, DIM), jnp.float32)] * 2,
                          *[spec((compressed_rows(KERNEL_LAYOUT, capacity), KV_HEADS, DIM), jnp.float32)] * 2)

    def compiled_ops(reselect_of):
        def verify(q, c, k, v, gates, length, injected):
            return nsa_tree_verify(q, c, k, v, gates if kind == "nsa" else None, length, jnp.asarray(parents),
                                   layout=wide, kind=kind, reselect=reselect_of(injected))
        hlo = jax.jit(verify).lower(
            spec((rows, HEADS, DIM), jnp.float32), cache, *[spec((rows, KV_HEADS, DIM), jnp.float32)] * 2,
            spec((rows, HEADS, 3), jnp.float32), spec((), jnp.int32),
            spec((rows, KV_HEADS, wide.top_n), jnp.int32)).compile().as_text()
        return collections.Counter(re.findall(r'custom_call_target="(TopK)"|= \S+ (dot)\(', hlo))

    refresh = compiled_ops(lambda injected: tree_reselect(mode))
    reuse = compiled_ops(lambda injected: tree_reselect(mode, injected=injected))
    assert refresh[("TopK", "")] > 0 and reuse[("TopK", "")] == 0
    if kind == "nsa-view":
        assert reuse[("", "dot")] < refresh[("", "dot")]
    else:  # NSA's compressed branch is part of the output
        assert reuse[("", "dot")] == refresh[("", "dot")]
