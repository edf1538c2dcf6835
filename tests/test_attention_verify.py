"""VerifyAttention on the kernel path (interpret mode): finished sequences skip their reads without touching the
active ones."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from models.attention import NewTokens, rope_tables
from vegas_jax.attention.verify import ScoreRequest, VerifyAttention
from vegas_jax.sharding import Placement

INTERPRET = Placement("interpret")


def test_inactive_sequences_read_only_their_new_rows(rng):
    batch, capacity, kv_heads, group, head_dim, queries = 3, 64, 2, 2, 32, 3
    starts = np.array([20, 40, 10])
    positions = jnp.asarray(starts[:, None] + np.arange(queries)[None, :], jnp.int32)
    heads = rng.standard_normal((batch, queries, kv_heads * (group + 2), head_dim))
    k_cache = rng.standard_normal((batch, capacity, kv_heads, head_dim))
    v_cache = rng.standard_normal((batch, capacity, kv_heads, head_dim))
    # Sequence 1 is finished: past its first S rows everything it could read is NaN, apart from the rows this
    # pass writes.
    k_cache[1, queries:], v_cache[1, queries:] = np.nan, np.nan
    cos, sin = rope_tables(positions, 10000.0 ** -(jnp.arange(0, head_dim, 2) / head_dim))
    new = NewTokens(jnp.asarray(heads, jnp.float32), cos, sin, num_kv_heads=kv_heads)
    caches = (jnp.asarray(k_cache[None], jnp.float32), jnp.asarray(v_cache[None], jnp.float32))  # [L=1, B, T, ...]
    every = VerifyAttention(ScoreRequest("logit"), num_layers=1, placement=INTERPRET)
    some = dataclasses.replace(every, active=jnp.asarray([True, False, True]))

    out_every, k_every, v_every, scores_every = every(0, new, positions, *caches)
    out_some, k_some, v_some, scores_some = some(0, new, positions, *caches)

    active = np.array([0, 2])
    np.testing.assert_array_equal(np.asarray(out_some)[active], np.asarray(out_every)[active])
    np.testing.assert_array_equal(np.asarray(scores_some)[active], np.asarray(scores_every)[active])
    # Every sequence's new K/V rows are written all the same.
    np.testing.assert_array_equal(np.asarray(k_some), np.asarray(k_every))
    np.testing.assert_array_equal(np.asarray(v_some), np.asarray(v_every))
    assert np.isnan(np.asarray(out_every)[1]).any()  # reading its whole length meets the NaN rows
    assert np.isfinite(np.asarray(out_some)[1]).all()  # skipping reads only rows [0, S)


def test_scored_tokens_limit_follows_where_the_kernel_collects():
    """The kernel collects the Vegas rows for one block of MAX_QUERY_ROWS query rows per KV head; other row sets,
    the jnp path and passes without scores have no limit."""
    vegas = VerifyAttention(ScoreRequest("logit"), num_layers=2, placement=INTERPRET)
    assert vegas.scored_tokens_limit(group=3) == 42 and vegas.scored_tokens_limit(group=4) == 32
    assert dataclasses.replace(vegas, placement=Placement("reference")).scored_tokens_limit(3) is None
    assert VerifyAttention(ScoreRequest("logit", rows="all"), 2, INTERPRET).scored_tokens_limit(3) is None
    assert VerifyAttention(None, 2, INTERPRET).scored_tokens_limit(3) is None
