"""Draft trees on NSA models in the decode loop (vegas_jax.attention.nsa_tree, the NSA family's tree verification
and commit), float32 on tiny random models whose prompts are longer than what the top-n blocks and the window
cover: greedy tree speculation with each drafter equals plain NSA greedy decoding token for token on ragged
batches (NSA-1B's selection rules, the NSA paper's, and the view of a dense model), and the caches after
acceptance, raw rows and compressed rows alike, equal plain decoding's; sampled trees keep the distribution
(the joint of four tokens against the exact float64 one computed from NSA prefill logits of every
continuation, chi-square); the loop's tree verification, batched, lowers to Triton for an H200.

Plain NSA decoding (the reference here) is itself checked against the float64 oracle in tests/test_nsa.py, and
every node of one tree pass against the oracle decoding its path in tests/test_nsa_verify.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig, NSALayout
from models.decoder import forward, init_params
from models.nsa_cache import NSACache
from tests.test_draft_trees import run_to_end
from tests.test_lossless_tiny import IdsTokenizer, prompts, scale_weight_matrices
from tests.test_sampling_distribution import VOCAB, chi_square_p_value, processed_probs, tiny_sampler
from vegas_jax.attention.family import with_attention
from vegas_jax.attention.nsa import NSAAttention
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.loading.bundle import LoadedModel

# Small versions of the layouts, so that 40-110-token prompts reach past the top-n blocks and the window:
# NSA-1B's rules (l = d = l', only the query's own block forced) and the NSA paper's (l = 2d overlapping compressed
# blocks spread onto selection blocks, the initial block and two local blocks forced).
LAYOUTS = {
    "nsa-1b": ("nsa", NSALayout(16, 16, 16, 2, 16, forced_initial=0, forced_local=1)),
    "paper": ("nsa", NSALayout(16, 8, 16, 4, 16, forced_initial=1, forced_local=2)),
    "view": ("nsa-view", NSALayout(16, 16, 16, 2, 16, forced_initial=1, forced_local=1)),
}
NEW = 16
LENGTHS = [70, 41, 103]


def tiny_model(name: str) -> Engine:
    kind, layout = LAYOUTS[name]
    dense = ModelConfig(
        architecture="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
        tie_word_embeddings=True, qk_norm=True)
    # NSA models have gate weights; the view is the dense model's own weights, attending as NSA.
    config = dataclasses.replace(dense, attention="nsa", nsa=layout) if kind == "nsa" else dense
    params = scale_weight_matrices(init_params(config, jnp.float32, 3), 6.0)
    if kind == "nsa-view":
        config = with_attention(config, "nsa-view", layout)
    return Engine(LoadedModel(config, params, IdsTokenizer(), "random", "random"))


_plain: dict = {}


def plain_run(name: str):
    """(engine, prompts, plain NSA greedy decoding's final state), once per model."""
    if name not in _plain:
        engine = tiny_model(name)
        ids = prompts(LENGTHS, engine.config.vocab_size, seed=1)
        ids[1] = ids[1][:20] + ids[1][:21]  # a repeated stretch: n-gram matches beyond the output's own loops
        _plain[name] = engine, ids, run_to_end(engine, ids, GenerationOptions(max_new_tokens=NEW))
    return _plain[name]


def emitted(state) -> list[list[int]]:
    output, count = np.asarray(state.output), np.asarray(state.num_generated)
    return [output[b, : count[b]].tolist() for b in range(len(count))]


# Each layout and each drafter in the quick suite, and a tree shaped by rank rates (irregular); the other pairs
# (slow) for time.
CASES = [("nsa-1b", "ngram", "3x2"), ("paper", "self", "2x3"), ("view", "self", "3x1"), ("view", "ngram", "7d3"),
         pytest.param("nsa-1b", "self", "2x2", marks=pytest.mark.slow),
         pytest.param("view", "ngram", "2x2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model, drafter, tree", CASES)
def test_greedy_tree_speculation_is_plain_nsa_decoding_with_its_caches(model, drafter, tree):
    engine, ids, plain = plain_run(model)
    state = run_to_end(engine, ids, GenerationOptions(max_new_tokens=NEW, draft_tree=tree, drafter=drafter))
    assert emitted(state) == emitted(plain)
    assert np.asarray(state.metrics.accepted).sum(0)[1] > 0  # paths of depth 2 and more were accepted
    committed = np.asarray(state.committed)
    np.testing.assert_array_equal(committed, np.asarray(plain.committed))
    layout = engine.config.nsa
    cache, want = state.cache, plain.cache
    for layer in range(engine.config.num_layers):
        for b, rows in enumerate(committed):
            # The compressed rows of every block complete before the committed length: pooled at commit.
            blocks = max((rows - layout.compress_block) // layout.compress_stride + 1, 0)
            for got, ref, n in ((cache.k, want.k, rows), (cache.v, want.v, rows), (cache.k_cmp, want.k_cmp, blocks),
                                (cache.v_cmp, want.v_cmp, blocks)):
                np.testing.assert_allclose(np.asarray(got[layer][b, :n]), np.asarray(ref[layer][b, :n]), atol=2e-5,
                                           rtol=1e-5, err_msg=f"layer {layer} sequence {b}")


# ---- sampling ------------------------------------------------------------------------------------------------
SAMPLED_NEW = 4  # the bootstrap token, then one 2x2 iteration: up to two drafts and a bonus
PROMPT_LENGTH = 40
SAMPLED = dict(temperature=1.0, top_k=3, top_p=0.9)
SEEDS = 4_000
# The view of test_sampling_distribution's tiny model: one selected block of 8 (the query's own) among 5, plus an
# 8-row window, so the 40-token prompt is mostly out of sight; the self drafter's sink and window differ from it.
SAMPLER_LAYOUT = NSALayout(8, 8, 8, 2, 8, forced_initial=0, forced_local=1)


def nsa_continuation_logits(engine: Engine, prompt: list[int], new: int) -> np.ndarray:
    """[V^(new-1), new, V]: NSA prefill logits (jnp, one pass per continuation; causal) of every continuation."""
    import itertools

    continuations = list(itertools.product(range(VOCAB), repeat=new - 1))
    seqs = jnp.asarray([prompt + list(c) for c in continuations], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    cache = NSACache.create(engine.config, len(continuations), 128, jnp.float32)
    attention = NSAAttention(engine.config.nsa, engine.config.attention)
    logits, _, _ = jax.jit(forward, static_argnames="config")(engine.model.params, seqs, positions, cache, attention,
                                                              config=engine.config)
    return np.asarray(logits)[:, len(prompt) - 1:]


def nsa_tree_sample(seeds: int = SEEDS, layout: NSALayout = SAMPLER_LAYOUT, prompt_length: int = PROMPT_LENGTH):
    """Sampled 2x2 trees on the NSA view of test_sampling_distribution's tiny model: counts of the first four
    tokens over `seeds` requests, their exact float64 joint, and the accepted-depth histogram (also
    benchmarks/check_lossless_gpu.py's, on a GPU, with a layout the GPU kernels take: blocks of 16 or more)."""
    dense = tiny_sampler()
    engine = Engine(dataclasses.replace(dense.model, config=with_attention(dense.config, "nsa-view", layout)))
    prompt = prompts([prompt_length], VOCAB, seed=5)[0]
    probs, margin = processed_probs(nsa_continuation_logits(engine, prompt, SAMPLED_NEW).astype(np.float64),
                                    **SAMPLED)
    assert margin > 1e-4
    joint = np.ones((VOCAB,) * SAMPLED_NEW)
    for i in range(SAMPLED_NEW):
        p = probs[:, i].reshape((VOCAB,) * SAMPLED_NEW)[(slice(None),) * i + (0,) * (SAMPLED_NEW - 1 - i)]
        joint *= p.reshape((VOCAB,) * (i + 1) + (1,) * (SAMPLED_NEW - 1 - i))
    opts = GenerationOptions(max_new_tokens=SAMPLED_NEW, draft_tree="2x2", prefill_chunk=80,
                             max_model_len=prompt_length + SAMPLED_NEW, **SAMPLED)
    result = engine.generate([prompt] * seeds, opts)
    counts = np.zeros((VOCAB,) * SAMPLED_NEW)
    np.add.at(counts, tuple(np.array([r.tokens for r in result.requests]).T), 1)
    return counts, joint, result.metrics["accepted_depth_histogram"]


def test_sampled_nsa_trees_keep_the_distribution():
    counts, joint, histogram = nsa_tree_sample()
    assert min(histogram) > 0.02 * sum(histogram), histogram  # rejections at the root, paths of depth 1 and 2
    p_value = chi_square_p_value(counts, joint)
    assert p_value > 1e-3, f"p = {p_value:.2e}"


def test_the_loops_tree_verification_lowers_to_triton_for_h200():
    """NSATreeVerify's vmap over the batch of nsa_tree_verify with its Pallas kernels and the loop's schedule
    (TREE_SCHEDULE), at NSA-1B's heads."""
    from h200_lowering import lower_for_h200
    from models.config import NSA_1B_LAYOUT
    from models.nsa_cache import NSALayerCache, compressed_rows
    from pallas_kernels.nsa_verify import nsa_tree_verify
    from vegas_jax.attention.nsa_tree import TREE_SCHEDULE
    from vegas_jax.decode.tree_shapes import TreeShape

    tree, batch, capacity, heads, kv_heads, dim = TreeShape.full(4, 2), 2, 4096, 32, 2, 64
    parents, rows, spec = jnp.asarray(tree.parents, jnp.int32), compressed_rows(NSA_1B_LAYOUT, capacity), \
        jax.ShapeDtypeStruct

    def verify(q, cache, tree_k, tree_v, gates, length):
        one = lambda *a: nsa_tree_verify(*a, parents, layout=NSA_1B_LAYOUT, kind="nsa", kernels="pallas",
                                         schedule=TREE_SCHEDULE)
        return jax.vmap(one)(q, cache, tree_k, tree_v, gates, length)

    kv = lambda n: spec((batch, n, kv_heads, dim), jnp.bfloat16)
    lowered = lower_for_h200(jax.jit(verify), spec((batch, tree.rows, heads, dim), jnp.bfloat16),
                             NSALayerCache(kv(capacity), kv(capacity), kv(rows), kv(rows)), kv(tree.rows),
                             kv(tree.rows), spec((batch, tree.rows, heads, 3), jnp.float32), spec((batch,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in lowered
