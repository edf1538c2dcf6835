"""Quantized draft weights: int8 / int4 quantization and dequantization against a float64 numpy reference of their
definition, the weight-only product against float64 numpy, the decoder's draft pass on quantized weights, and the
memory plan's count of them. GGUF's own blocks are tested in test_gguf.py, decoding with quantized drafts in
test_lossless_tiny.py, test_sampling_distribution.py and test_lossless_smollm2.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import draft_weights
from models.decoder import forward, init_params, per_layer
from models.kv_cache import KVCache
from models.quantized import (
    FORMULATIONS,
    QuantizedWeight,
    dequantize,
    in_bytes,
    in_words,
    integer_codes,
    overlay,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantized_matmul,
)
from pallas_kernels.weight_only_matmul import pack_code_words
from tests.test_kernels_weight_only import numpy_int8_rows
from tests.test_lossless_tiny import tiny_engine
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.decode.draft_kernel import CODE_LAYOUTS, codes_in_words, codes_transposed, with_kernel
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.inputs import InputError
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.runtime.memory import draft_per_device
from vegas_jax.sharding import Placement


def reference_int8(w: np.ndarray):
    """Per output channel of w [K, O]: scale = max |w| / 127, q = round(w / scale); float64."""
    scale = np.abs(w).max(axis=0, keepdims=True) / 127
    return np.round(w / scale), scale, w / scale


def reference_int4(w: np.ndarray, group: int):
    """Per group of `group` rows of w [K, O]: 16 levels from the group's min (the offset) to its max; float64."""
    g = w.reshape(w.shape[0] // group, group, -1)
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = (hi - lo) / 15
    exact = (g - lo) / scale
    return np.round(exact).reshape(w.shape), scale[:, 0], lo[:, 0], exact.reshape(w.shape)


def assert_codes_match(got: np.ndarray, want: np.ndarray, exact: np.ndarray):
    """Integer codes equal the reference's except where the exact quotient is within float32 rounding of a tie."""
    near_tie = np.abs(exact - np.floor(exact) - 0.5) < 1e-4
    assert np.mean(near_tie) < 0.01
    np.testing.assert_array_equal(got[~near_tie], want[~near_tie])


def test_int8_per_channel_against_numpy(rng):
    w = rng.standard_normal((96, 5, 8)) * rng.uniform(0.1, 3, (1, 5, 8))
    q = quantize_int8(jnp.asarray(w, jnp.float32), in_ndim=1)
    assert q.values.dtype == jnp.int8 and q.values.shape == (96, 5, 8) and q.scale.shape == (1, 5, 8)
    assert q.offset is None and q.groups == 1
    codes, scale, exact = reference_int8(w.reshape(96, 40))
    assert_codes_match(np.asarray(q.values).reshape(96, 40), codes, exact)
    np.testing.assert_allclose(np.asarray(q.scale).reshape(1, 40), scale, rtol=1e-6)
    back = np.asarray(dequantize(q)).reshape(96, 40)
    assert np.all(np.abs(back - w.reshape(96, 40)) <= scale / 2 * (1 + 1e-5))


@pytest.mark.parametrize("in_ndim,shape,group", [(1, (64, 3, 8), 32), (2, (4, 32, 24), 64)])
def test_int4_groups_against_numpy(rng, in_ndim, shape, group):
    """Groups along the (flattened) input axis, codes packed two a byte (split-half within each group): in_ndim 2
    is o_proj's [heads, head_dim, hidden]."""
    w = rng.standard_normal(shape) + rng.uniform(-1, 1, (1,) * (len(shape) - 1) + shape[-1:])
    k = int(np.prod(shape[:in_ndim]))
    flat = w.reshape(k, -1)
    q = quantize_int4(jnp.asarray(w, jnp.float32), group, in_ndim=in_ndim)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (k // 2,) + shape[in_ndim:]
    assert q.bits == 4 and q.input_size == k and q.groups == k // group and q.group_size == group
    codes, scale, offset, exact = reference_int4(flat, group)
    assert_codes_match(np.asarray(integer_codes(q)).reshape(k, -1), codes, exact)
    # the packing, by its definition: byte row G * group / 2 + j holds rows G * group + j and + group / 2
    packed = np.asarray(q.values).reshape(k // group, group // 2, -1)
    low, high = codes.reshape(k // group, 2, group // 2, -1).transpose(1, 0, 2, 3)
    near_tie = np.abs(exact - np.floor(exact) - 0.5).reshape(low.shape[:1] + (2,) + low.shape[1:]) < 1e-4
    assert np.array_equal((packed & 15)[~near_tie[:, 0]], low[~near_tie[:, 0]])
    assert np.array_equal((packed >> 4)[~near_tie[:, 1]], high[~near_tie[:, 1]])
    np.testing.assert_allclose(np.asarray(q.scale).reshape(scale.shape), scale, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(q.offset).reshape(offset.shape), offset, rtol=1e-6)
    back = np.asarray(dequantize(q)).reshape(k, -1)
    step = np.repeat(scale, group, axis=0)
    assert np.all(np.abs(back - flat) <= step / 2 * (1 + 1e-4) + 1e-6)


def _random_weight(rng, kind: str, k: int, out: tuple, groups: int, in_ndim: int):
    """(a QuantizedWeight of random codes, scales and (int4) offsets, its codes [K, *out] as numpy)."""
    if kind == "int8":
        ints = rng.integers(-127, 128, (k,) + out)
        values = jnp.asarray(ints, jnp.int8)
    else:
        ints = rng.integers(0, 16, (k,) + out)
        values = pack_int4(jnp.asarray(ints), k // groups)
    scale = rng.uniform(0.01, 0.1, (groups,) + out).astype(np.float32)
    offset = rng.uniform(-0.5, 0.5, (groups,) + out).astype(np.float32) if kind == "int4" else None
    weight = QuantizedWeight(values, jnp.asarray(scale), None if offset is None else jnp.asarray(offset), in_ndim)
    return weight, ints


def float64_weight(ints: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """The weight [K, N] by its definition (codes times their group's scale, plus its offset), in float64."""
    groups, k = w.groups, ints.shape[0]
    full = ints.astype(np.float64).reshape(groups, k // groups, -1) * np.asarray(w.scale, np.float64).reshape(
        groups, 1, -1)
    if w.offset is not None:
        full += np.asarray(w.offset, np.float64).reshape(groups, 1, -1)
    return full.reshape(k, -1)


def float64_product(x: np.ndarray, ints: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """x [M, K] times the weight by its definition, in float64."""
    return x.astype(np.float64) @ float64_weight(ints, w)


PRODUCT_CASES = [
    ("int8", 1, (64,), (48,)),  # per channel: (x @ q) * scale
    ("int8", 4, (64,), (3, 16)),  # GGUF Q8_0's groups
    ("int4", 2, (64,), (48,)),  # groups with offsets
    ("int4", 4, (4, 32), (32,)),  # o_proj's two contracted axes
]


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("kind,groups,in_shape,out", PRODUCT_CASES)
def test_quantized_matmul_against_float64(rng, kind, groups, in_shape, out, formulation):
    k = int(np.prod(in_shape))
    w, ints = _random_weight(rng, kind, k, out, groups, len(in_shape))
    x = rng.standard_normal((2, 3) + in_shape).astype(np.float32)
    got = np.asarray(jax.jit(quantized_matmul, static_argnums=(2, 3))(jnp.asarray(x), w, None, formulation))
    want = float64_product(x.reshape(6, k), ints, w).reshape((2, 3) + out)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kind,groups,in_shape,out", PRODUCT_CASES)
def test_the_kernel_product_against_float64(rng, kind, groups, in_shape, out):
    """With kernels the product is the Pallas weight-only matmul (interpret mode here), in the same layouts."""
    k = int(np.prod(in_shape))
    w, ints = _random_weight(rng, kind, k, out, groups, len(in_shape))
    (w,) = jax.tree.leaves(with_kernel([w], Placement(backend="interpret")),
                           is_leaf=lambda a: isinstance(a, QuantizedWeight))
    assert w.kernel is not None
    x = rng.standard_normal((5,) + in_shape).astype(np.float32)
    got = np.asarray(quantized_matmul(jnp.asarray(x), w, jnp.float32))
    want = float64_product(x.reshape(5, k), ints, w).reshape((5,) + out)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kind,groups,in_shape,out", PRODUCT_CASES)
def test_codes_in_words_are_the_kernels_words_and_multiply_alike(rng, kind, groups, in_shape, out):
    k = int(np.prod(in_shape))
    w, ints = _random_weight(rng, kind, k, out, groups, len(in_shape))
    words = in_words(w)
    assert (words.bits, words.input_size, words.group_size, words.values.dtype) == (w.bits, k, w.group_size,
                                                                                   jnp.int32)
    flat = lambda a: np.asarray(a).reshape(a.shape[0], -1)  # noqa: E731
    np.testing.assert_array_equal(flat(words.values), np.asarray(pack_code_words(jnp.asarray(flat(w.values)))))
    back = in_bytes(words)
    assert back.word_bits is None and back.values.dtype == w.values.dtype
    np.testing.assert_array_equal(np.asarray(back.values), np.asarray(w.values))
    x = rng.standard_normal((3,) + in_shape).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quantized_matmul(jnp.asarray(x), words)),
                               float64_product(x.reshape(3, k), ints, w).reshape((3,) + out), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind,groups,in_shape,out", [
    ("int4", 2, (256,), (128,)),  # groups of 128 with offsets, two a pipeline step
    ("int4", 4, (4, 64), (2, 64)),  # o_proj's two contracted axes, groups of 64
    ("int8", 1, (128,), (256,)),  # per channel
])
@pytest.mark.parametrize("rows", [1, 5, 17])  # 17: two passes of the kernel's 16 rows
def test_codes_transposed_round_trip_and_multiply_alike(rng, kind, groups, in_shape, out, rows):
    """The Mosaic GPU kernel's layout (interpret mode here): codes_transposed picks the weights it tiles, in_bytes
    gives back the stored codes bit for bit, and the product is the float64 one within the kernel's rounding of
    each dequantized weight to bf16."""
    k = int(np.prod(in_shape))
    w, ints = _random_weight(rng, kind, k, out, groups, len(in_shape))
    (t,) = jax.tree.leaves(codes_transposed([w]), is_leaf=lambda a: isinstance(a, QuantizedWeight))
    assert t.transposed and (t.bits, t.input_size, t.group_size, t.out_shape) == (w.bits, k, w.group_size, out)
    assert t.values.shape == (int(np.prod(out)), k)
    back = in_bytes(t)
    assert not back.transposed and back.values.dtype == w.values.dtype
    np.testing.assert_array_equal(np.asarray(back.values), np.asarray(w.values))
    (t,) = jax.tree.leaves(with_kernel([t], Placement(backend="interpret")),
                           is_leaf=lambda a: isinstance(a, QuantizedWeight))
    x = rng.standard_normal((rows,) + in_shape).astype(np.float32)
    got = np.asarray(quantized_matmul(jnp.asarray(x), t, jnp.float32))
    want = float64_product(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)).reshape(rows, k), ints, w)
    assert np.max(np.abs(got.reshape(rows, -1) - want)) < 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_code_layouts_convert_from_any_layout(rng, kind):
    """A loaded model keeps one copy of a precision's draft tree and converts it to whichever layout the next run
    asks for (LoadedModel.draft_params): every layout reached from every other holds the stored codes bit for bit
    (words from transposed once packed the transposed codes four features a word)."""
    w, _ = _random_weight(rng, kind, 256, (128,), 2 if kind == "int4" else 1, 1)
    tree = [w]
    for layout in ("transposed", "words", "transposed", "bytes", "words", "bytes", "transposed", "transposed",
                   "words", "words", "bytes"):
        tree = CODE_LAYOUTS[layout](tree)
        (t,) = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, QuantizedWeight))
        assert (bool(t.transposed), bool(t.word_bits)) == (layout == "transposed", layout == "words"), layout
        np.testing.assert_array_equal(np.asarray(in_bytes(t).values), np.asarray(w.values), err_msg=layout)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_stacked_layers_change_layout_a_layer_at_a_time(rng, kind):
    """A stacked draft tree [L, ...] changes layout layer by layer: each layer as the one-layer conversion gives it,
    a weight already in the asked layout kept (not copied), and the conversion's program holds no more than a
    fraction of one layer's codes (vmapped over the whole stack it held every layer's unpacked int32 codes at once:
    14 GiB for Llama-3.1-8B's gate/up projection, out of memory on an H100 beside the model)."""
    layers = [_random_weight(rng, kind, 256, (128,), 2 if kind == "int4" else 1, 1)[0] for _ in range(4)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    for layout in ("transposed", "words"):
        convert = CODE_LAYOUTS[layout]
        got = convert({"layers": {"w": stacked}})["layers"]["w"]
        for i, layer in enumerate(layers):
            (want,) = jax.tree.leaves(convert([layer]), is_leaf=lambda a: isinstance(a, QuantizedWeight))
            np.testing.assert_array_equal(np.asarray(got.values[i]), np.asarray(want.values), err_msg=layout)
            assert (got.transposed, got.word_bits) == (want.transposed, want.word_bits)
        assert convert({"layers": {"w": got}})["layers"]["w"].values is got.values, layout
        unpacked_layer = 256 * 128 * 4  # one layer's codes as int32
        program = jax.jit(lambda w: convert({"layers": {"w": w}})).lower(stacked).compile()
        assert program.memory_analysis().temp_size_in_bytes < unpacked_layer / 4, layout


def test_weights_the_transposed_kernel_does_not_tile_stay_in_bytes(rng):
    """Groups of 32 int4 codes (GGUF Q4_0 / Q4_1) fill 16 bytes a row of shared memory, and 100 features no block:
    those weights keep the Triton kernel's layout."""
    for k, out, groups in [(256, (128,), 8), (128, (100,), 1)]:
        w, _ = _random_weight(rng, "int4" if groups > 1 else "int8", k, out, groups, 1)
        (t,) = jax.tree.leaves(codes_transposed([w]), is_leaf=lambda a: isinstance(a, QuantizedWeight))
        assert not t.transposed and t.values is w.values


def int8_step(x: np.ndarray, x_group: int) -> np.ndarray:
    """The int8 rounding step of each position of x [M, K] (symmetric per group of positions: max |x| / 127), in
    float32 as int8_rows defines it: a float64 step moved a code across a rounding tie once in a few hundred
    seeds."""
    grouped = x.astype(np.float32).reshape(x.shape[0], -1, x_group)
    step = np.abs(grouped).max(-1, keepdims=True) / np.float32(127)
    return np.broadcast_to(np.where(step > 0, step, np.float32(1)), grouped.shape).reshape(x.shape)


def numpy_int8_activations(x: np.ndarray, x_group: int) -> np.ndarray:
    """x [M, K] rounded to int8 per group of positions by the definition (numpy_int8_rows: float64, a rounding tie
    within float32's rounding as the implementation took it; float32 quotients here moved a code across a tie in
    about one run in forty), float64."""
    codes, scales = numpy_int8_rows(x, x_group)
    return codes * np.repeat(scales, x_group, axis=1)


@pytest.mark.parametrize("backend,words", [("interpret", False), ("interpret", True), ("reference", False)])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kind,groups,in_shape,out", PRODUCT_CASES)
def test_int8_activations_multiply_the_rounded_rows(rng, kind, groups, in_shape, out, rows, backend, words):
    """Draft products with int8 activations: the kernel's integer paths (one row, codes as stored or in words; five
    rows of int4 codes), the float kernel on rounded rows (five rows of int8 codes), XLA's product on rounded rows
    (no kernels), each against float64 of the rows
    rounded by definition (groups of 64 or 128 positions: the largest dividing K in whole int4 groups)."""
    k = int(np.prod(in_shape))
    w, ints = _random_weight(rng, kind, k, out, groups, len(in_shape))
    tree = codes_in_words([w]) if words else [w]
    assert jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, QuantizedWeight))[0].word_bits == (w.bits if words
                                                                                                    else None)
    (w,) = jax.tree.leaves(with_kernel(tree, Placement(backend=backend), "int8"),
                           is_leaf=lambda a: isinstance(a, QuantizedWeight))
    x = rng.standard_normal((rows,) + in_shape).astype(np.float32)
    got = np.asarray(quantized_matmul(jnp.asarray(x), w, jnp.float32))
    x_group = 128 if k % 128 == 0 else 64
    want = float64_product(numpy_int8_activations(x.reshape(rows, k), x_group), ints, w)
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Rounded, and no further from the unrounded product than half a step at every position allows (a bound that
    # holds for every draw, where a fixed fraction of the product's size failed one seed in a few hundred).
    error = np.abs(got.reshape(rows, -1) - float64_product(x.reshape(rows, k), ints, w))
    allowed = int8_step(x.reshape(rows, k), x_group) / 2 @ np.abs(float64_weight(ints, w))
    assert error.max() > 1e-4 * allowed.max()
    assert np.all(error <= allowed * (1 + 1e-4) + 1e-5 * np.abs(want).max())


def test_int8_activations_need_a_group_that_divides_k():
    w, _ = _random_weight(np.random.default_rng(0), "int8", 48, (16,), 1, 1)
    with pytest.raises(ValueError, match="no group of 128, 64, 32 positions divides K = 48"):
        with_kernel([w], Placement(backend="reference"), "int8")
    # A model with such a width is refused by the plan, before anything is allocated or traced.
    base = tiny_engine()
    config = dataclasses.replace(base.config, hidden_size=48, num_heads=3, num_kv_heads=1)
    engine = Engine(LoadedModel(config, init_params(config, jnp.float32, 0), base.tokenizer, "random", "random"))
    options = GenerationOptions(method="vegas", draft_weights="int8", draft_activations="int8", max_new_tokens=4)
    with pytest.raises(InputError, match="draft_activations.* int8: .*no group of 128, 64, 32 positions divides K = 48"):
        engine.plan([[1, 2, 3]], options)


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine(vocab=96, layers=1, weight_scale=1.0, tied=True)


def test_draft_pass_reads_the_quantized_weights(tiny):
    """The decoder on a draft tree (every linear weight and the tied LM head quantized, over the model's own norms
    and embedding) gives logits near the full-precision ones, and not the same: it read the copies."""
    params, config = tiny.model.params, tiny.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    quantize = jax.jit(draft_weights.quantize_params, static_argnums=(1, 2))
    trees = {p: quantize(params, config, p) for p in ("int8", "int4")}
    assert all(set(per_layer(t)["layers"][0]) == set(draft_weights.LAYER_WEIGHTS) and "lm_head" in t
               for t in trees.values())

    @jax.jit
    def logits(params, trees):  # one compilation for the three passes
        cache = KVCache.create(config, 2, 16, jnp.float32)
        run = lambda p: forward(p, tokens, positions, cache, DenseAttention(), config=config)[0]  # noqa: E731
        return run(params), {k: run(overlay(params, t)) for k, t in trees.items()}

    full, drafted = jax.tree.map(np.asarray, logits(params, trees))
    for precision, tolerance in (("int8", 0.03), ("int4", 0.3)):
        error = np.abs(drafted[precision] - full).max() / np.abs(full).max()
        assert 0 < error < tolerance, (precision, error)


def test_memory_plan_counts_the_draft_weights(tiny):
    """The plan's draft bytes (from the quantizer's shapes, before the copies exist) equal the bytes of the copies
    made by the run, counted here from their shapes (int4 codes two a byte), scales and offsets float32."""
    batch = [[1, 2, 3, 4, 5]]
    for precision in ("int8", "int4"):
        options = GenerationOptions(method="vegas", gamma=2, max_new_tokens=4, draft_weights=precision,
                                    min_sparse_tokens=2)
        planned = tiny.plan(batch, options)["bytes_per_device"]
        tree = tiny.model.draft_params(precision)
        counted = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        assert per_layer(tree)["layers"][0]["down_proj"].bits == int(precision[3:])
        assert planned["draft_weights"] == counted == draft_per_device(tree, Placement())
        bf16 = tiny.plan(batch, dataclasses.replace(options, draft_weights="bf16"))["bytes_per_device"]
        assert planned["total"] == bf16["total"] + counted and bf16["draft_weights"] == 0
