"""NSA tree verification: every node's output from one V0 or V1 pass (their selected branch in XLA and through the
Pallas kernels in interpret mode), and from the oracle twin nsa_tree_reference, equals the float64 oracle decoding
the node's root-to-node path (paths that complete a compressed and a selection block included); V1 equals V0;
V1's union and row masks equal a brute-force set union."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import NSA_1B_LAYOUT, NSA_PAPER_LAYOUT, NSA_VIEW_LAYOUT
from models.nsa_cache import NSALayerCache, compressed_rows, write_tokens
from nsa_reference import nsa_rows
from pallas_kernels.nsa_tree_select import V1Launch, pack_members, row_block_slots, v0_selected, v0_view, v1_selected
from pallas_kernels.nsa_verify import nsa_tree_reference, nsa_tree_verify, union_schedule

HEADS, KV_HEADS, DIM = 4, 2, 16
# A binary top and a deep chain: 20 nodes, depth 13, so the deepest paths cross block boundaries.
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 9, 11, 12, 13, 14, 15, 16, 17, 18], np.int32)
# (layout, kind, capacity, committed length, selected-branch implementations): the paths from the length complete
# a compressed block (and, for NSA-1B and the view, a selection block: 300 + 13 > 303; the paper's at 1039) past
# the covered prefix. The XLA and kernel paths share everything but the selected prefix rows, so the paper's
# layout and the view run the kernels only; the oracle twin runs on NSA-1B's (compilations dominate these tests'
# time).
BOTH, KERNELS = (None, "interpret"), ("interpret",)
CASES = [(NSA_1B_LAYOUT, "nsa", 384, 300, BOTH, True), (NSA_PAPER_LAYOUT, "nsa", 1152, 1030, KERNELS, False),
         (NSA_VIEW_LAYOUT, "nsa-view", 384, 305, KERNELS, False)]


def root_path(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


@pytest.fixture(scope="module", params=CASES, ids=["nsa-1b", "paper", "view"])
def tree_case(request):
    layout, kind, capacity, length, implementations, twin = request.param
    rng = np.random.default_rng(capacity + length)
    k, v = (rng.normal(size=(capacity, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    nodes = len(PARENTS)
    q = rng.normal(size=(nodes, HEADS, DIM)).astype(np.float32)
    tree_k, tree_v = (rng.normal(size=(nodes, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    gates = rng.uniform(size=(nodes, HEADS, 3)).astype(np.float32) if kind == "nsa" else None
    zeros = lambda rows: jnp.zeros((1, rows, KV_HEADS, DIM), jnp.float32)
    cache = NSALayerCache(zeros(capacity), zeros(capacity), zeros(compressed_rows(layout, capacity)),
                          zeros(compressed_rows(layout, capacity)))
    cache = write_tokens(cache, jnp.asarray(k[None, :length]), jnp.asarray(v[None, :length]),
                         jnp.arange(length)[None], layout)
    cache = jax.tree.map(lambda x: x[0], cache)
    args = (jnp.asarray(q), cache, jnp.asarray(tree_k), jnp.asarray(tree_v),
            None if gates is None else jnp.asarray(gates), jnp.int32(length), jnp.asarray(PARENTS))
    verify = jax.jit(nsa_tree_verify,
                     static_argnames=("layout", "kind", "schedule", "kernels", "v1_launch", "return_blocks"))
    outputs = {(s, kernels): verify(*args, layout=layout, kind=kind, schedule=s, kernels=kernels, return_blocks=True)
               for s in ("v0", "v1") for kernels in implementations}
    if twin:  # and V1's kernel over 16-row blocks (40 rows: 3 of them), one program each and all in one program
        for name, launch in (("v1-rows16", V1Launch(block_rows=16)),
                             ("v1-row-loop", V1Launch(block_rows=16, row_loop=True))):
            outputs[name, "interpret"] = verify(*args, layout=layout, kind=kind, schedule="v1", kernels="interpret",
                                                v1_launch=launch, return_blocks=True)
        outputs["twin"] = (jax.jit(nsa_tree_reference, static_argnames=("layout", "kind"))(
            args[0], jax.tree.map(lambda x: x[None], cache), *args[2:], layout=layout, kind=kind), None)
    return dict(layout=layout, kind=kind, length=length, k=k, v=v, q=q, tree_k=tree_k, tree_v=tree_v,
                gates=gates, capacity=capacity, outputs=outputs)


def test_every_node_equals_float64_decoding_of_its_path(tree_case):
    c = tree_case
    for node in range(len(PARENTS)):
        path = root_path(node)
        keys = np.concatenate([c["k"][:c["length"]], c["tree_k"][path]])
        values = np.concatenate([c["v"][:c["length"]], c["tree_v"][path]])
        queries = np.zeros((len(keys), HEADS, DIM))
        queries[-1] = c["q"][node]
        gates = np.zeros((len(keys), HEADS, 3))
        if c["gates"] is not None:
            gates[-1] = c["gates"][node]
        want = nsa_rows(queries, keys, values, gates, c["layout"], c["kind"], [len(keys) - 1])[0]
        for variant, (out, _) in c["outputs"].items():
            np.testing.assert_allclose(np.asarray(out[node]), want, atol=2e-5, err_msg=f"{variant} node {node}")


def test_v1_equals_v0(tree_case):
    outputs = tree_case["outputs"]
    for key in filter(lambda key: key != "twin" and key[0] != "v0", outputs):
        (out0, blocks0), (out1, blocks1) = outputs["v0", key[1]], outputs[key]
        np.testing.assert_array_equal(blocks0, blocks1)
        np.testing.assert_allclose(np.asarray(out1), np.asarray(out0), atol=1e-6, err_msg=str(key))


@pytest.mark.parametrize("length", [1, 15, 16, 100, 130, 263, 337])
def test_the_view_tree_pass_equals_float64_at_every_kind_of_length(rng, length):
    """The NSA view's tree pass, V0 (its view kernel, split and whole) and V1 (its selected-rows kernel, the window
    and the tree's rows in XLA) in interpret mode, against float64 decoding of each node's path, at lengths from one
    row to past a selection's reach: no complete compressed block (1, 15), a prefix that is whole blocks (16), a
    window wider than the prefix (100), the window's start inside a block (130, 263), and more blocks than the top n
    (263, 337), so that the window reads rows of blocks the node did not select. The cache past the length holds
    random rows, as rejected drafts leave it, which every read must ignore."""
    layout, capacity = NSA_VIEW_LAYOUT, 384
    k, v = (rng.normal(size=(capacity, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(len(PARENTS), HEADS, DIM)).astype(np.float32)
    tree_k, tree_v = (rng.normal(size=(len(PARENTS), KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    zeros = lambda rows: jnp.zeros((1, rows, KV_HEADS, DIM), jnp.float32)  # noqa: E731
    rows = compressed_rows(layout, capacity)
    cache = write_tokens(NSALayerCache(zeros(capacity), zeros(capacity), zeros(rows), zeros(rows)),
                         jnp.asarray(k[None]), jnp.asarray(v[None]), jnp.arange(capacity)[None], layout)
    cache = jax.tree.map(lambda x: x[0], cache)
    args = (jnp.asarray(q), cache, jnp.asarray(tree_k), jnp.asarray(tree_v), None, jnp.int32(length),
            jnp.asarray(PARENTS))
    outputs = {schedule: np.asarray(verify(*args)) for schedule, verify in _VIEW_VERIFY.items()}
    for node in range(len(PARENTS)):
        path = root_path(node)
        keys, values = np.concatenate([k[:length], tree_k[path]]), np.concatenate([v[:length], tree_v[path]])
        queries = np.zeros((len(keys), HEADS, DIM))
        queries[-1] = q[node]
        want = nsa_rows(queries, keys, values, np.zeros((len(keys), HEADS, 3)), layout, "nsa-view",
                        [len(keys) - 1])[0]
        for schedule, out in outputs.items():
            np.testing.assert_allclose(out[node], want, atol=2e-5, err_msg=f"{schedule}, length {length}, node {node}")


# One program a schedule for every length of the test above (the length is traced); V0's view kernel as batch 1
# splits it (four splits) and as a batch that fills the GPU does (one).
_VIEW_VERIFY = {f"{schedule}, batch {batch}": jax.jit(functools.partial(
    nsa_tree_verify, layout=NSA_VIEW_LAYOUT, kind="nsa-view", schedule=schedule, kernels="interpret", batch=batch))
    for schedule, batch in (("v0", 1), ("v0", 64), ("v1", 1))}


def test_union_schedule_equals_sets_on_random_selections(rng):
    """union_schedule against Python sets on random selections: any padding, repeats within and across nodes,
    unions from empty to every block."""
    # A few shapes, many selections each: every new shape is a new compilation, and those were this test's time.
    schedule = jax.jit(union_schedule, static_argnums=1)
    shapes = [tuple(int(x) for x in (rng.integers(1, 9), rng.integers(1, 4), rng.integers(1, 6), rng.integers(1, 40)))
              for _ in range(5)] + [(1, 1, 1, 1), (8, 3, 5, 3)]
    for nodes, heads, top_n, num_blocks in (shape for shape in shapes for _ in range(12)):
        blocks = np.maximum(rng.integers(-num_blocks // 2, num_blocks, (nodes, heads, top_n)), -1).astype(np.int32)
        union, count, member = map(np.asarray, schedule(jnp.asarray(blocks), num_blocks))
        assert union.shape == (heads, min(nodes * top_n, num_blocks))
        for head in range(heads):
            want = sorted({int(b) for b in blocks[:, head].ravel() if b >= 0})
            assert count[head] == len(want) and list(union[head, :count[head]]) == want
            assert (union[head, count[head]:] == -1).all()
            for node in range(nodes):
                got = {int(u) for u, m in zip(union[head], member[head, node]) if m}
                assert got == {int(b) for b in blocks[node, head] if b >= 0}


@pytest.mark.parametrize("group, block_r", [(16, 128), (16, 32), (3, 16), (5, 16)])
def test_row_block_slots_are_the_slots_their_nodes_selected(rng, group, block_r):
    """V1's per-row-block lists against Python sets: a node whose G rows straddle two row blocks (G 3, 5) is
    in both, and a block with no selected slot has an empty list."""
    nodes, heads, width = 20, 2, 24
    member = rng.random((heads, nodes, width)) < 0.15
    member[:, : block_r // group + 1] = False  # the first row block (and a straddling node) selected nothing
    slots, counts = map(np.asarray, row_block_slots(jnp.asarray(member), group, block_r))
    assert slots.shape == (heads, -(-nodes * group // block_r), width)
    for head in range(heads):
        for rb in range(slots.shape[1]):
            touching = [t for t in range(nodes) if t * group < (rb + 1) * block_r and (t + 1) * group > rb * block_r]
            want = sorted({u for t in touching for u in range(width) if member[head, t, u]})
            assert counts[head, rb] == len(want) and list(slots[head, rb, :counts[head, rb]]) == want
    assert (counts[:, 0] == 0).all()


def test_union_and_masks_equal_a_brute_force_union(tree_case):
    _, blocks = tree_case["outputs"]["v1", "interpret"]
    blocks = np.asarray(blocks)
    num_blocks = tree_case["capacity"] // tree_case["layout"].select_block
    union, count, member = map(np.asarray, union_schedule(jnp.asarray(blocks), num_blocks))
    for head in range(KV_HEADS):
        want = sorted({int(b) for b in blocks[:, head].ravel() if b >= 0})
        assert count[head] == len(want) and list(union[head, :count[head]]) == want
        assert (union[head, count[head]:] == -1).all()
        for node in range(len(PARENTS)):
            chosen = {int(b) for b in blocks[node, head] if b >= 0}
            assert {int(u) for u, m in zip(union[head], member[head, node]) if m} == chosen
    # The tree's nodes share blocks: the union is smaller than the sum of the selections (V1's saving).
    assert count.max() < len(PARENTS) * tree_case["layout"].top_n


def test_member_words_hold_one_bit_per_node(rng):
    """pack_members against bits set one by one in numpy: nodes past 32 land in the second word."""
    for nodes in (1, 31, 33, 64):
        member = rng.random((2, nodes, 5)) < 0.5
        words = np.asarray(pack_members(jnp.asarray(member))).view(np.uint32)
        want = np.zeros((2, 5, 2), np.uint64)
        for h, t, u in zip(*np.nonzero(member)):
            want[h, u, t // 32] += 1 << (t % 32)
        np.testing.assert_array_equal(words, want.astype(np.uint32))


@pytest.mark.parametrize("nodes, local", [(48, False), (64, False), (64, True)])
def test_v1_kernel_equals_v0_kernel_past_32_nodes(rng, nodes, local):
    """The kernels alone on random selections of a wide tree (member masks of two words), unions spread over
    fewer blocks than splits and row blocks that span nodes of both words: V1's (o, lse) equals V0's. local: each
    32-row block's nodes (16, G 2) pick among 4 blocks of their own, so most union blocks are none of a row
    block's, which its list leaves out; and one KV head selects nothing (an empty union)."""
    capacity, select_block, top_n = 256, 16, 4
    q = jnp.asarray(rng.normal(size=(nodes, HEADS, DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(capacity, KV_HEADS, DIM)), jnp.float32) for _ in range(2))
    # Distinct blocks per node (top-n's output; V0 would count a repeat twice), some -1 pads: a node with none
    # has lse -inf in both.
    pick = lambda t: (t // 16 % 3) * 4 + rng.permutation(4) if local else rng.permutation(12)[:top_n]  # noqa: E731
    blocks = np.stack([np.stack([pick(t) for _ in range(KV_HEADS)]) for t in range(nodes)])
    blocks = np.where(rng.random(blocks.shape) < 0.2, -1, blocks).astype(np.int32)
    blocks[:, 1] = np.where(local, -1, blocks[:, 1])  # local: KV head 1's union is empty (lse -inf everywhere)
    length = jnp.int32(150)  # blocks 10 and 11 are past the prefix, 9 partly: masked in both schedules
    o0, lse0 = v0_selected(q, k, v, jnp.asarray(blocks), length, select_block=select_block, interpret=True)
    union, count, member = union_schedule(jnp.asarray(blocks), capacity // select_block)
    assert (np.asarray(count)[1] == 0) == local
    # 32-row blocks hold 16 nodes (one member word); 128-row blocks 64 (both words).
    for launch in (V1Launch(block_rows=32), V1Launch(block_rows=32, row_loop=True, num_splits=3), V1Launch()):
        o1, lse1 = v1_selected(q, k, v, union, member, length, select_block=select_block, launch=launch,
                               interpret=True)
        np.testing.assert_array_equal(np.isfinite(lse1), np.isfinite(lse0))
        finite = np.isfinite(np.asarray(lse0))
        np.testing.assert_allclose(np.asarray(lse1)[finite], np.asarray(lse0)[finite], atol=1e-5)
        np.testing.assert_allclose(np.asarray(o1), np.asarray(o0), atol=1e-5, err_msg=str(launch))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_the_v1_kernel_lowers_to_triton_for_h200():
    """NSA-1B's shapes at 32K with a 64-node tree: member words, per-row-block slot lists, 8 row blocks."""
    from h200_lowering import lower_for_h200

    nodes, capacity, width = 64, 32768, 1024
    spec = jax.ShapeDtypeStruct
    lowered = lower_for_h200(
        jax.jit(functools.partial(v1_selected, select_block=16)), spec((nodes, 32, 64), jnp.bfloat16),
        spec((capacity, 2, 64), jnp.bfloat16), spec((capacity, 2, 64), jnp.bfloat16), spec((2, width), jnp.int32),
        spec((2, nodes, width), jnp.bool_), spec((), jnp.int32))
    assert lowered.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_the_view_kernel_lowers_to_triton_for_h200():
    """SmolLM2's view at 8K with a 4x2 tree (31 nodes, padded to 32 tree rows): selected, window and tree rows."""
    from h200_lowering import lower_for_h200

    nodes, capacity = 31, 8192
    spec = jax.ShapeDtypeStruct
    lowered = lower_for_h200(
        jax.jit(functools.partial(v0_view, select_block=16, window=128)), spec((nodes, 9, 64), jnp.bfloat16),
        spec((capacity, 3, 64), jnp.bfloat16), spec((capacity, 3, 64), jnp.bfloat16), spec((nodes, 3, 16), jnp.int32),
        spec((), jnp.int32), spec((nodes, 3, 64), jnp.bfloat16), spec((nodes, 3, 64), jnp.bfloat16),
        spec((nodes, nodes), jnp.bool_))
    assert lowered.count("__gpu$xla.gpu.triton") == 1


def test_v1_launch_for_a_batch_aims_at_the_target_program_count():
    """The split counts measured fastest on the H200 at 32K x 64 nodes x G 16 (16 at batch 1, 4 at batch 8), one
    split once the batch alone fills the GPU, and 16 at most."""
    assert [V1Launch.for_batch(b, 2, 64 * 16).num_splits for b in (1, 8, 64)] == [16, 4, 1]
    assert V1Launch.for_batch(8, 3, 15 * 3).num_splits == 16  # SmolLM2's view: one row block of 45 rows
