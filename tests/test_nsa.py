"""NSA attention against the float64 numpy oracle (tests/nsa_reference.py): the jnp prefill and every decode step
(jnp and the Pallas kernels in interpret mode) across block boundaries and in the first blocks, for NSA-1B's layout,
the NSA paper's and the view; fla-org NSA checkpoints load and generate as the oracle's model does; variants that
cannot run exactly are refused in one line."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from models.attention import NewTokens
from models.config import NSA_1B_LAYOUT, NSA_PAPER_LAYOUT, NSA_VIEW_LAYOUT, NSALayout, UnsupportedModelError
from models.nsa_cache import NSALayerCache, compressed_rows
from nsa_reference import model_logits, nsa_rows
from vegas_jax.attention.nsa import NSAAttention
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.loading import load_model
from vegas_jax.sharding import Placement

FIXTURES = Path(__file__).parent / "fixtures"
HEADS, KV_HEADS, DIM = 4, 2, 16
# l > l' and a short window: many selections and compressed blocks straddling selection blocks in a short sequence.
SMALL_LAYOUT = NSALayout(32, 16, 16, 4, 32, forced_initial=1, forced_local=1)


def random_sequence(length: int, seed: int):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(length, h, DIM)) for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, rng.uniform(size=(length, HEADS, 3))


def empty_cache(layout, capacity):
    raw = lambda rows: jnp.zeros((1, rows, KV_HEADS, DIM), jnp.float32)
    return NSALayerCache(raw(capacity), raw(capacity), raw(compressed_rows(layout, capacity)),
                         raw(compressed_rows(layout, capacity)))


@functools.lru_cache(maxsize=None)
def attention_step(layout, kind, backend):
    """A jitted NSAAttention call on one layer cache; q, k, v come pre-rotated (identity RoPE tables)."""
    attention = NSAAttention(layout, kind, Placement(backend=backend))

    def step(cache, q, k, v, gates, positions):
        ones = jnp.ones(q.shape[:2] + (DIM,), jnp.float32)
        new = NewTokens(jnp.concatenate([q, k, v], axis=2), ones, 0 * ones, KV_HEADS,
                        gates if kind == "nsa" else None)
        out, cache, _ = attention(0, new, positions, cache)
        return out, cache

    return jax.jit(step)


def run(step, cache, seq, start, stop):
    """Rows [start, stop) of `seq` through `step` as one call; (out [stop - start, H_q, D], cache)."""
    as_batch = lambda x: jnp.asarray(x[None, start:stop], jnp.float32)
    positions = jnp.arange(start, stop, dtype=jnp.int32)[None]
    out, cache = step(cache, *map(as_batch, seq), positions)
    return np.asarray(out[0]), cache


def boundary_rows(layout, length):
    """Rows at the edges of the first compressed and selection blocks, of the window, and of the last blocks."""
    edges = {0, 1, layout.compress_block - 1, layout.compress_block, layout.select_block - 1, layout.select_block,
             layout.window, length - layout.select_block - 1, length - layout.select_block, length - 1}
    return sorted(t for t in edges if 0 <= t < length)


PREFILL_CASES = [(SMALL_LAYOUT, "nsa", 160), (SMALL_LAYOUT, "nsa-view", 160), (NSA_1B_LAYOUT, "nsa", 384),
                 (NSA_PAPER_LAYOUT, "nsa", 1152), (NSA_VIEW_LAYOUT, "nsa-view", 384)]


@pytest.mark.parametrize("layout, kind, length", PREFILL_CASES, ids=lambda x: getattr(x, "window", x))
def test_prefill_rows_match_the_float64_reference(layout, kind, length):
    seq = random_sequence(length, seed=length)
    out, _ = run(attention_step(layout, kind, "reference"), empty_cache(layout, length), seq, 0, length)
    rows = boundary_rows(layout, length)
    np.testing.assert_allclose(out[rows], nsa_rows(*seq, layout, kind, rows), atol=2e-5)


# (layout, kind, capacity, decoded ranges): the first blocks from an empty cache, and a stretch past the point
# where the top-n blocks no longer cover the prefix, crossing selection and compressed block boundaries.
DECODE_CASES = [(NSA_1B_LAYOUT, "nsa", 384, [(0, 20), (310, 330)]),
                (NSA_PAPER_LAYOUT, "nsa", 1152, [(0, 34), (1016, 1034)]),
                (NSA_VIEW_LAYOUT, "nsa-view", 384, [(0, 18), (316, 324)])]


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("layout, kind, capacity, spans", DECODE_CASES, ids=["nsa-1b", "paper", "view"])
def test_decode_step_t_equals_reference_prefill_row_t(layout, kind, capacity, spans, backend):
    """One token at a time into the cache (the compressed rows written as blocks complete), each step's output
    against the reference prefill's row; the kernels run where backend is interpret."""
    seq = random_sequence(capacity, seed=capacity + 1)
    prefill, decode = attention_step(layout, kind, "reference"), attention_step(layout, kind, backend)
    decoded = [t for start, stop in spans for t in range(start, stop)]
    expected = dict(zip(decoded, nsa_rows(*seq, layout, kind, decoded)))
    for start, stop in spans:
        cache = empty_cache(layout, capacity)
        if start:
            _, cache = run(prefill, cache, seq, 0, start)
        for t in range(start, stop):
            out, cache = run(decode, cache, seq, t, t + 1)
            np.testing.assert_allclose(out[0], expected[t], atol=2e-5, err_msg=f"step {t}")


def test_a_wrong_selection_rule_is_caught():
    """The oracle tells the rules apart: without the forced sink block (NSA-1B's rule on the view's layout) the
    outputs past the covered prefix differ."""
    seq = random_sequence(384, seed=5)
    rows = [340, 383]
    wrong = dataclasses.replace(NSA_VIEW_LAYOUT, forced_initial=0)
    out, _ = run(attention_step(NSA_VIEW_LAYOUT, "nsa-view", "reference"), empty_cache(NSA_VIEW_LAYOUT, 384), seq,
                 0, 384)
    assert np.abs(out[rows] - nsa_rows(*seq, wrong, "nsa-view", rows)).max() > 1e-2


# ---- fla-org NSA checkpoints ---------------------------------------------------------------------------------

TINY_NSA = {"architectures": ["LlamaNSAForCausalLM"], "model_type": "llama-nsa", "hidden_size": 64,
            "intermediate_size": 64, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": DIM, "num_hidden_layers": 2, "vocab_size": 288, "rms_norm_eps": 1e-5, "rope_theta": 500.0,
            "max_position_embeddings": 1024, "tie_word_embeddings": True, "hidden_act": "silu",
            "block_size": 16, "block_counts": 2, "window_size": 16, "bos_token_id": 1, "eos_token_id": 2}


def tiny_nsa_weights(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under fla-org's names, torch layouts ([out, in] linears)."""
    rng = np.random.default_rng(seed)
    d, h, kv, f = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"]
    w = lambda *shape: rng.normal(scale=0.3, size=shape).astype(np.float32)
    weights = {"model.embed_tokens.weight": w(hf["vocab_size"], d), "model.norm.weight": 1 + w(d)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": 1 + w(d), p + "post_attention_layernorm.weight": 1 + w(d),
                    p + "self_attn.q_proj.weight": w(h * DIM, d), p + "self_attn.k_proj.weight": w(kv * DIM, d),
                    p + "self_attn.v_proj.weight": w(kv * DIM, d), p + "self_attn.o_proj.weight": w(d, h * DIM),
                    p + "self_attn.g_proj.weight": w(h * 3, d), p + "mlp.gate_proj.weight": w(f, d),
                    p + "mlp.up_proj.weight": w(f, d), p + "mlp.down_proj.weight": w(d, f)}
    return weights


def write_tiny_nsa(folder, config: dict):
    """An HF folder in fla-org's format: config.json, random weights, tiny Llama's tokenizer."""
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tiny_nsa_weights(config), folder / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny-llama" / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def nsa_folder(tmp_path_factory):
    return write_tiny_nsa(tmp_path_factory.mktemp("tiny-nsa"), TINY_NSA)


def oracle_layout():
    return NSALayout(16, 16, 16, TINY_NSA["block_counts"], TINY_NSA["window_size"], forced_initial=0,
                     forced_local=1)


def test_checkpoint_loads_as_nsa_and_matches_the_oracle(nsa_folder):
    from models.decoder import forward
    from models.nsa_cache import NSACache

    loaded = load_model(nsa_folder, jnp.float32)
    assert loaded.config.attention == "nsa" and loaded.config.nsa == oracle_layout()
    tokens = np.random.default_rng(1).integers(0, TINY_NSA["vocab_size"], 80)
    cache = NSACache.create(loaded.config, 1, 128, jnp.float32)
    logits, _, _ = jax.jit(forward, static_argnames="config")(
        loaded.params, jnp.asarray(tokens[None], jnp.int32), jnp.arange(80, dtype=jnp.int32)[None], cache,
        NSAAttention(loaded.config.nsa), config=loaded.config)
    want = model_logits(tiny_nsa_weights(TINY_NSA), TINY_NSA, oracle_layout(), tokens)
    np.testing.assert_allclose(np.asarray(logits[0]), want, atol=2e-4 * np.abs(want).max())


def test_checkpoint_generates_greedy_as_the_oracle_decodes(nsa_folder):
    """Plain greedy decoding through the engine (prefill, then one NSA step per token) against the oracle's
    argmax over the whole sequence at each step, past the prefix the two selected blocks and the window cover."""
    engine = Engine(load_model(nsa_folder, jnp.float32))
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, TINY_NSA["vocab_size"], 60)]
    result = engine.generate([prompt], GenerationOptions(max_new_tokens=6))
    weights, tokens = tiny_nsa_weights(TINY_NSA), list(prompt)
    for _ in range(6):
        tokens.append(int(np.argmax(model_logits(weights, TINY_NSA, oracle_layout(), np.array(tokens))[-1])))
    assert result.requests[0].tokens == tokens[len(prompt):]


def test_the_memory_plan_counts_the_nsa_cache_it_allocates(nsa_folder):
    from models.nsa_cache import NSACache

    engine = Engine(load_model(nsa_folder, jnp.float32))
    plan = engine.plan([[5] * 40, [6] * 70], GenerationOptions(max_new_tokens=8))
    cache = jax.eval_shape(lambda: NSACache.create(engine.config, plan["batch_rows"], plan["cache_capacity"],
                                                   jnp.float32))
    assert plan["bytes_per_device"]["kv_cache"] == sum(x.size * 4 for x in jax.tree.leaves(cache))


def test_the_zen_e_nsa_1b_config_is_nsa_1b():
    hf = {**TINY_NSA, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
          "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 16, "vocab_size": 128256,
          "rope_theta": 500000.0, "block_size": 16, "block_counts": 16, "window_size": 128}
    from models.config import ModelConfig

    config = ModelConfig.from_hf(hf)
    assert config.attention == "nsa" and config.nsa == NSA_1B_LAYOUT and config.group_size == 16


@pytest.mark.parametrize("change, culprit", [
    ({"window_size": None}, "window_size"),
    ({"block_counts": [16, 8]}, "block_counts"),
    ({"architectures": ["NSAForCausalLM"]}, "NSAForCausalLM"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_an_nsa_variant_that_cannot_run_exactly_is_refused(change, culprit):
    from models.config import ModelConfig

    with pytest.raises(UnsupportedModelError) as error:
        ModelConfig.from_hf({**TINY_NSA, **change})
    assert culprit in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("flags, culprit", [(["--attention", "nsa-view"], "--attention"),
                                            (["--method", "vegas"], "--method"),
                                            (["--draft-tree", "2x2", "--method", "vegas"], "--method")])
def test_the_cli_refuses_what_an_nsa_checkpoint_cannot_do_in_one_line(nsa_folder, flags, culprit, capsys):
    from vegas_jax import generate

    rc = generate.main(["--model", str(nsa_folder), "--prompt", "hi", "--max-new-tokens", "2", "--quiet", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and culprit in err[0]


def test_an_unknown_attention_kind_is_one_line(capsys):
    from vegas_jax import generate

    rc = generate.main(["--model", str(FIXTURES / "tiny-llama"), "--attention", "sparse", "--prompt", "hi",
                        "--max-new-tokens", "2", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: --attention must be one of dense, nsa-view"), err


@pytest.mark.slow
def test_smollm2_view_equals_dense_while_its_blocks_cover_the_prefix_and_departs_past_it():
    """SmolLM2's NSA view over real text: rows up to 16 blocks of 16 tokens select every block, so their logits
    are dense SmolLM2's; rows past that attend a subset and differ."""
    from models.decoder import forward
    from models.kv_cache import KVCache
    from models.nsa_cache import NSACache
    from vegas_jax.attention.dense import DenseAttention
    from vegas_jax.attention.family import with_attention

    loaded = load_model(None, jnp.float32)
    view = with_attention(loaded.config, "nsa-view")
    tokens = loaded.tokenizer.encode(open(json.__file__, encoding="utf-8").read(), add_special_tokens=False)[:384]
    ids, positions = jnp.asarray([tokens], jnp.int32), jnp.arange(384, dtype=jnp.int32)[None]
    run = jax.jit(forward, static_argnames="config")
    dense, _, _ = run(loaded.params, ids, positions, KVCache.create(loaded.config, 1, 384, jnp.float32),
                      DenseAttention(), config=loaded.config)
    sparse, _, _ = run(loaded.params, ids, positions, NSACache.create(view, 1, 384, jnp.float32),
                       NSAAttention(view.nsa, "nsa-view"), config=view)
    covered = view.nsa.top_n * view.nsa.select_block  # 256
    np.testing.assert_allclose(np.asarray(sparse[0, :covered]), np.asarray(dense[0, :covered]), atol=2e-3)
    assert np.abs(np.asarray(sparse[0, covered + 64:]) - np.asarray(dense[0, covered + 64:])).max() > 0.1
