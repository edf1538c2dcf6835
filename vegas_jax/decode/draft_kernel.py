"""Where kernels run (the GPU), the draft pass multiplies by its quantized weights through a weight-only kernel: XLA
keeps the int -> bf16 convert out of its GEMMs at decode shapes and reads no fewer bytes than for bf16 weights (on
the H200, 4096 x 6144 at rows 1-16: int8 0.37 TB/s through XLA, 1.6-1.9 TB/s through the Triton-lowered kernel;
benchmarks/results/weight-only-2026-12-01-kernel-times.json).

Two kernels, each with the codes in its own layout (`code_layout`; the engine makes a layout once and keeps it):
- the Mosaic GPU kernel (pallas_kernels/weight_only_mgpu.py), codes transposed: on a Hopper GPU, one device, bf16
  activations and up to 16 rows. At Llama-3.1-8B's shapes on the H100 a layer's four int4 products took 70-74 us at
  1-16 rows against the Triton kernel's 91 (one row) and 138 (8 rows), the LM head 117 us against 168-244
  (benchmarks/results/draft-products-2026-12-05-h100.json, bench_draft_products.py);
- the Triton-lowered kernels (pallas_kernels/weight_only_matmul.py), codes in bytes or words: everything else.
`with_kernel` gives every quantized weight of a draft tree that a kernel tiles that kernel as its product
(models.quantized.QuantizedWeight.kernel), which models.quantized.quantized_matmul then calls; weights no kernel
tiles (an output width that is no multiple of 16, such as a 4-token vocabulary) keep XLA's product. On a mesh the
Triton kernels run inside the program on each device's shard, whose groups are whole (models.draft_weights).

With int8 activations (GenerationOptions.draft_activations) every draft product first rounds its rows of x to int8
per group of positions (pallas_kernels.weight_only_matmul.int8_rows): at one row the kernel then multiplies in
integers (its integer_dot path, PTX dp4a), int4 codes at 2-16 rows too (an int8 tensor-core dot: on the H200 at
Llama-3.1-8B's shapes a layer's four products at 2-16 rows took 106-109 us against the float kernel's 130-134 and
bf16 cuBLAS's 113-119; int8 codes there took 118-121 against the float kernel's 108-112, so they keep it,
benchmarks/results/weight-only-2026-12-02-rows.json); otherwise, or without kernels, the rounded rows go through
the float product. The drafts' numerics are the same either way, up to float rounding; verification keeps the
output exact. Where kernels run and a batch has one row with int8 activations, the codes are held four rows a word
(one load a word, where codes as stored take four strided loads; on the H200 at Llama-3.1-8B's shapes a layer's
int4 products took 65 us against 80, and the float kernel's 90, benchmarks/results/weight-only-2026-12-02-s24-
integer-int4.json); in the loop at batch 1 x 32K on the H100 that path's draft step took 3.41 ms against the Mosaic
GPU kernel's 3.82 with bf16 activations (draft-precision-2026-12-05-135440-random.json).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from models.quantized import (
    TRANSPOSED_INT4_ZERO, QuantizedWeight, in_bytes, in_transposed, in_words, quantized_matmul,
)
from pallas_kernels import weight_only_mgpu
from pallas_kernels._common import NUM_SMS
from pallas_kernels.weight_only_matmul import INT8_DOT_MIN_K, int8_rows, weight_only_matmul
from vegas_jax.sharding import Placement

# The largest blocks (block_k, block_n) tried, by path: the fastest measured on the H200 at Llama-3.1-8B's shapes
# (benchmarks/results/weight-only-2026-12-02-int4-variants.json, -rows.json); 16: Triton's smallest dot.
MAX_BLOCKS = {"one row": (32, 256), "rows": (64, 128), "integer rows": (64, 256)}
MIN_BLOCK = 16
INTEGER_ROWS = 16  # the most rows the integer dot multiplies (pallas_kernels.weight_only_matmul)


ACTIVATIONS = ("bf16", "int8")  # what a draft product multiplies: x as computed, or x rounded to int8 per group
X_GROUPS = (128, 64, 32)  # int8 activations' group along K: the largest that divides K (and, int4, holds groups)


def with_kernel(draft_params, placement: Placement, activations: str = "bf16"):
    """The draft tree with the kernel as the product of every weight it tiles (unchanged without kernels), and with
    int8 activations, every weight's product rounding x first."""
    if draft_params is None or (not placement.uses_kernels and activations == "bf16"):
        return draft_params
    if activations not in ACTIVATIONS:
        raise ValueError(f"draft activations {activations!r}: one of {', '.join(ACTIVATIONS)}")

    def attach(w):
        if not isinstance(w, QuantizedWeight):
            return w
        x_group = None if activations == "bf16" else int8_group(w)
        if w.transposed:  # codes_transposed chose the Mosaic GPU kernel for this weight
            return dataclasses.replace(w, kernel=functools.partial(_mgpu_product, interpret=placement.interpret,
                                                                   x_group=x_group))
        tiled = placement.uses_kernels and _blocks(w, "rows") is not None
        if not tiled and x_group is None:
            return w
        product = (functools.partial(_product, interpret=placement.interpret, x_group=x_group) if tiled
                   else functools.partial(_xla_product, x_group=x_group))
        return dataclasses.replace(w, kernel=product)

    return _map_weights(attach, draft_params)


def codes_in_words(draft_params):
    """The draft tree with the codes of every weight the integer kernel multiplies four rows a word (its layout;
    the others in bytes). Made beside the tree it is given: both are held until that one is dropped."""
    def pack(w):
        w = in_bytes(w)  # the tree may hold another layout: LoadedModel.draft_params keeps one copy
        if _blocks(w, "one row") is None or w.values.shape[0] % 4:
            return w
        int8_group(w)  # the integer path's condition (Engine's plan has refused a model that fails it)
        return in_words(w)

    return _map_weights(pack, draft_params)


def codes_transposed(draft_params):
    """The draft tree with the codes of every weight the Mosaic GPU kernel tiles transposed (its layout; the others
    in bytes). Made beside the tree it is given, as codes_in_words."""
    return _map_weights(lambda w: in_transposed(w) if _mgpu_blocks(w) else in_bytes(w), draft_params)


def codes_in_bytes(draft_params):
    """codes_in_words or codes_transposed undone."""
    return _map_weights(in_bytes, draft_params)


def check_int8_activations(draft_params) -> None:
    """ValueError (int8_group's) when a weight of the draft tree admits no group for int8 activations."""
    tree = draft_params
    if isinstance(tree, dict) and "layers" in tree:  # a stacked layer weight: checked as one layer's (all alike)
        layer_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree["layers"])
        tree = tree | {"layers": layer_shapes}
    for w in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(w, QuantizedWeight):
            int8_group(w)


CODE_LAYOUTS = {"bytes": codes_in_bytes, "words": codes_in_words, "transposed": codes_transposed}


def code_layout(placement: Placement, activations: str, rows: int) -> str:
    """How a draft tree's codes are held for drafts over `rows` batch rows (a key of CODE_LAYOUTS): in words where
    the integer kernel multiplies int8 activations one row at a time; transposed where the Mosaic GPU kernel
    multiplies (a Hopper GPU, one device, at most its 16 rows: beyond them it would read the codes once per 16
    rows, where the Triton kernel reads them once); else in bytes."""
    if placement.uses_kernels and activations == "int8" and rows == 1:
        return "words"
    if placement.backend == "pallas" and placement.mesh is None and rows <= weight_only_mgpu.MAX_ROWS and (
            _hopper()):
        return "transposed"
    return "bytes"


def _hopper() -> bool:
    """Whether the default device has wgmma (compute capability 9.x), which the Mosaic GPU kernel needs."""
    return getattr(jax.devices()[0], "compute_capability", "").startswith("9.")


def _map_weights(fn, tree):
    """fn on every QuantizedWeight of a draft tree; on its stacked "layers" ([L, ...] arrays) on each layer's
    weight (layer_by_layer), so that fn's choices (blocks, groups, layouts) see one layer's shapes."""
    one = lambda w: fn(w) if isinstance(w, QuantizedWeight) else w  # noqa: E731
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    if not (isinstance(tree, dict) and "layers" in tree):  # weights of one layer (or the LM head) alone
        return jax.tree.map(one, tree, is_leaf=is_weight)
    mapped = {k: jax.tree.map(one, v, is_leaf=is_weight) for k, v in tree.items() if k != "layers"}
    return mapped | {"layers": jax.tree.map(lambda w: layer_by_layer(one, w), tree["layers"], is_leaf=is_weight)}


def layer_by_layer(fn, stacked):
    """fn on each layer of a stacked weight [L, ...], one layer after another inside one program (`lax.map`):
    vmapped over the whole stack, fn's intermediates are held for every layer at once, and unpacking the int4 codes
    of Llama-3.1-8B's stacked gate/up projection to int32 alone is 14 GiB, which an H100 holding the model could
    not allocate. A weight that fn leaves in its layout comes back as it is, not copied."""
    layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    if _signature(jax.eval_shape(fn, layer)) == _signature(layer):
        return stacked
    # Compiled at each conversion: a loaded model's draft tree changes layout when a run asks for another one.
    return jax.jit(lambda stacked: jax.lax.map(fn, stacked))(stacked)


def _signature(tree) -> tuple:
    """What a layout is: the tree's structure (QuantizedWeight's static fields included) and its arrays' shapes."""
    return jax.tree.structure(tree), tuple((x.shape, x.dtype) for x in jax.tree.leaves(tree))


def int8_group(w: QuantizedWeight) -> int:
    """The group of positions along K that int8 activations share a scale over, for this weight; ValueError where
    no group fits."""
    k = w.input_size
    fits = [g for g in X_GROUPS if k % g == 0 and (w.bits == 8 or g % w.group_size == 0)]
    if not fits:
        raise ValueError(f"int8 activations: no group of {', '.join(map(str, X_GROUPS))} positions divides K = {k}"
                         + (f" in whole weight groups of {w.group_size}" if w.bits == 4 else ""))
    return fits[0]


def _largest_power_of_2_dividing(n: int, most: int) -> int:
    block = most
    while block > MIN_BLOCK and n % block:
        block //= 2
    return block


def _blocks(w: QuantizedWeight, path: str) -> tuple[int, int] | None:
    """(block_k, block_n) that tile this weight for the kernel's path (a key of MAX_BLOCKS), or None. Whether a
    weight tiles does not depend on the path (every block shrinks to MIN_BLOCK)."""
    n = math.prod(w.out_shape)
    rows_per_group = w.group_size // (2 if w.bits == 4 else 1)  # rows of the stored codes under one scale
    most_k, most_n = MAX_BLOCKS[path]
    block_k = _largest_power_of_2_dividing(rows_per_group, most_k)
    block_n = _largest_power_of_2_dividing(n, most_n)
    if rows_per_group % block_k or n % block_n:
        return None
    return block_k, block_n


def _rounded(x: jax.Array, x_group: int | None) -> jax.Array:
    """x's rows as int8 activations see them (int8_rows' codes times scales), in x's dtype; x without a group."""
    if x_group is None:
        return x
    codes, scales = int8_rows(x, x_group)
    return (codes.reshape(x.shape[0], -1, x_group) * scales[..., None]).reshape(x.shape).astype(x.dtype)


def _product(x: jax.Array, w: QuantizedWeight, out_dtype, *, interpret: bool, x_group: int | None) -> jax.Array:
    """models.quantized's kernel signature: x [M, K] times the weight -> [M, prod(out)] in out_dtype."""
    rows = x.shape[0]
    # Several rows multiply in integers in blocks of at least the int8 dot's K: int4 groups of 32 (GGUF's Q4_0 /
    # Q4_1) give blocks of 16 bytes, whose rows are rounded and multiplied in floating point, the same products.
    integer_dot = x_group is not None and (rows == 1 or (
        w.bits == 4 and rows <= INTEGER_ROWS and w.group_size // 2 >= INT8_DOT_MIN_K))
    if w.word_bits and (rows > 1 or not integer_dot):  # only the one-row integer path reads words
        w = in_bytes(w.one_layer())  # a layout made per call: of this layer's codes alone
    path = "one row" if rows == 1 else "integer rows" if integer_dot else "rows"
    block_k, block_n = _blocks(w, path)  # the kernel takes block_k down to x_group for its integer path
    return weight_only_matmul(x if integer_dot else _rounded(x, x_group), _flat(w, w.values), _flat(w, w.scale),
                              _flat(w, w.offset), w.layer, bits=w.bits, group=w.group_size, block_k=block_k,
                              block_n=block_n, interpret=interpret, out_dtype=out_dtype, integer_dot=integer_dot,
                              x_group=x_group or 128)


def _flat(w: QuantizedWeight, a: jax.Array | None) -> jax.Array | None:
    """One of w's arrays with its output axes flattened, [(L,) rows, prod(out)] (stacked layers kept whole: the
    kernels read their layer in place)."""
    return None if a is None else a.reshape(a.shape[: (w.layer is not None) + 1] + (-1,))


MGPU_BLOCK_N = 128  # output features a program of the Mosaic GPU kernel owns
MGPU_BLOCK_KS = (256, 128, 64)  # K positions a pipeline step loads, the largest that tiles
MGPU_MIN_GROUP_BYTES = 32  # a group's codes in a row of shared memory: 16 bytes leave no swizzle to read through
# Split K until this many programs per SM would run, with `MGPU_STAGES` blocks in flight: the fastest tiling of the
# H100 sweep (benchmarks/results/weight-only-mgpu-tiling-2026-12-06-h100.json; Llama-3.1-8B gate/up at one row 31.8
# us against 35.6 for 2 programs and 4 stages, whose 448 programs ran 1.7 waves; down 18.0 against 19.1).
MGPU_PROGRAMS_PER_SM = 4
MGPU_STAGES = 2


def _mgpu_blocks(w: QuantizedWeight) -> tuple[int, int, int] | None:
    """(block_n, block_k, splits) of the Mosaic GPU kernel for this weight, or None where it does not tile: K
    split while fewer than MGPU_PROGRAMS_PER_SM programs per SM would run, keeping two steps a program."""
    n, k, group = math.prod(w.out_shape), w.input_size, w.group_size
    fits = [b for b in MGPU_BLOCK_KS if k % b == 0 and (group % b == 0 or b % group == 0)]
    if n % MGPU_BLOCK_N or not fits or min(group, fits[0]) * w.bits < 8 * MGPU_MIN_GROUP_BYTES:
        return None
    block_k, splits = fits[0], 1
    while ((n // MGPU_BLOCK_N) * splits < MGPU_PROGRAMS_PER_SM * NUM_SMS and k % (2 * splits * block_k) == 0
           and k // (2 * splits * block_k) >= 2):
        splits *= 2
    return MGPU_BLOCK_N, block_k, splits


def _mgpu_product(x: jax.Array, w: QuantizedWeight, out_dtype, *, interpret: bool,
                  x_group: int | None) -> jax.Array:
    """models.quantized's kernel signature through the Mosaic GPU kernel (codes transposed), 16 rows at a time."""
    block_n, block_k, splits = _mgpu_blocks(w)
    product = functools.partial(
        weight_only_mgpu.weight_only_matmul_mgpu, wt=w.values, scale=_flat(w, w.scale), offset=_flat(w, w.offset),
        layer=w.layer, group=w.group_size, zero_point=TRANSPOSED_INT4_ZERO if w.bits == 4 else 0, block_n=block_n,
        block_k=block_k, splits=splits, stages=MGPU_STAGES, out_dtype=out_dtype,
        interpret=interpret)
    x = _rounded(x, x_group)
    rows = weight_only_mgpu.MAX_ROWS
    return jax.numpy.concatenate([product(x[i: i + rows]) for i in range(0, x.shape[0], rows)])


def _xla_product(x: jax.Array, w: QuantizedWeight, out_dtype, *, x_group: int) -> jax.Array:
    """XLA's product (models.quantized) of the rounded rows, for weights the kernel does not multiply."""
    flat = dataclasses.replace(w, kernel=None, in_ndim=1)  # x comes as [M, K] (codes in words: integer_codes reads)
    return quantized_matmul(_rounded(x, x_group), flat, out_dtype).reshape(x.shape[0], -1)
