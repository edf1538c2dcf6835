"""Decoding on device meshes equals decoding on one device: tokens, drafts accepted, selections, for every mesh shape
tested, on a tiny random Qwen3 and on the real SmolLM2; continuous batching on a data-parallel mesh; two processes
on one global mesh; the layout of the cache after the loop and the collectives the compiled loop contains; bad
meshes refused with one line.

Each scenario runs in a subprocess of this file with `--xla_force_host_platform_device_count`, so the CPU has the
devices the scenario needs whatever the rest of the suite sees; it prints one JSON object that the test checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


def run_scenario(name: str, devices: int, timeout: int = 900) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, name], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- scenarios (run in the subprocess) -----------------------------------------------------------------------

def _tiny_qwen3():
    """8 query / 4 KV heads, so that model axes of 1, 2 and 4 all divide; large weights make attention peaky, so a
    sparse draft really differs from the target and selections matter."""
    import jax
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.decoder import init_params
    from tests.test_lossless_tiny import IdsTokenizer, scale_weight_matrices
    from vegas_jax.loading.bundle import LoadedModel

    config = ModelConfig(
        architecture="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=4, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
        tie_word_embeddings=True, qk_norm=True,
    )
    params = scale_weight_matrices(init_params(config, jnp.float32, 0), 6.0)
    return LoadedModel(config, params, IdsTokenizer(), "random", "random")


def _run_to_end(engine, batch, options) -> dict:
    """Tokens, per-request draft counts and the final selection of a whole decode, from the loop's state."""
    import numpy as np

    started = engine.start(batch, options)
    rows = started.state.committed.shape[0]
    state = started.decode(engine.model.params, started.draft_params, started.state, np.int32(2**31 - 1), np.int32(rows))
    host = started.config.placement.fetch({
        "output": state.output, "n": state.num_generated, "accepted": state.metrics.accepted,
        "drafted": state.metrics.drafted, "indices": state.selection.indices, "counts": state.selection.counts,
        **({} if state.logprobs is None else {"logprobs": state.logprobs.chosen, "top_ids": state.logprobs.top_ids}),
        "chosen": None if state.gamma_control is None else state.gamma_control.chosen,
    })
    n = len(batch)
    selected = [[sorted(host["indices"][layer, b, : host["counts"][layer, b]].tolist()) for b in range(n)]
                for layer in range(host["indices"].shape[0])]
    return {
        "tokens": [host["output"][b, : host["n"][b]].tolist() for b in range(n)],
        "logprobs": [host["logprobs"][b, : host["n"][b]] if "logprobs" in host else [] for b in range(n)],
        "top_ids": [host["top_ids"][b, : host["n"][b]].tolist() if "top_ids" in host else [] for b in range(n)],
        "accepted": host["accepted"][:n].tolist(),
        "drafted": host["drafted"][:n].tolist(),
        "selected": selected,
        "chosen": None if host["chosen"] is None else host["chosen"].tolist(),  # adaptive γ: iterations by g
        "state": state,
        "decode": started.decode,
    }


# A draft tree: sampled self drafts (tree attention over each shard's heads, the selection from the scores of every
# head) with logprobs and a stop id. (Greedy n-gram trees on data=4, model=2 equal one device too; left out for time.)
TREE_CASES = [("vegas", 0.8, ["data=2,model=4"], dict(draft_tree="2x2", gamma=2, logprobs=2, stop_token_ids=(7,)))]


def scenario_tiny() -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from tests.test_lossless_tiny import GREEDY, prompts
    from vegas_jax.runtime.engine import Engine
    from vegas_jax.sharding import make_mesh

    loaded = _tiny_qwen3()
    batch = prompts([45, 12, 80, 30, 64], loaded.config.vocab_size, seed=5)  # 5 requests: padded on data=2, 4, 8
    one = Engine(loaded)
    meshes = {"data=8": (8, 1), "data=4,model=2": (4, 2), "data=2,model=4": (2, 4)}
    engines = {name: Engine(loaded.on_mesh(make_mesh({"data": d, "model": m}))) for name, (d, m) in meshes.items()}
    out = {"runs": []}
    # Greedy Vegas on every mesh; each other case on one mesh with a model axis (compilations dominate the time).
    # Sampled Vegas with every penalty (their token counts split over data), min-p, logprobs and a stop id, drafting
    # from int4 weights with adaptive γ (fixed costs: one g per iteration for the whole batch).
    controls = dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.4, min_p=0.05, logprobs=2,
                    stop_token_ids=(7,), draft_weights="int4", gamma="auto", gamma_max=4,
                    gamma_costs=(1.7, 2.1, 2.5, 2.9))  # γ_max 4: five branches to compile, not nine
    cases = [("vegas", 0.0, list(meshes), {}), ("ar", 0.0, ["data=4,model=2"], {}),
             ("streaming", 0.0, ["data=2,model=4"], {}), ("quest", 0.0, ["data=4,model=2"], {}),
             ("vegas", 0.8, ["data=2,model=4"], controls)] + TREE_CASES
    for method, temperature, names, extra in cases:
        options = dataclasses.replace(GREEDY, method=method, temperature=temperature, max_new_tokens=40, **extra)
        reference = _run_to_end(one, batch, options)
        for name in names:
            engine = engines[name]
            got = _run_to_end(engine, batch, options)
            out["runs"].append({
                "method": method, "temperature": temperature, "mesh": name, "controls": extra is controls,
                "tree": extra.get("draft_tree"),
                **{k: got[k] == reference[k] for k in ("tokens", "accepted", "drafted", "selected", "top_ids", "chosen")},
                "logprobs": all(np.allclose(a, b, atol=1e-5) for a, b in zip(got["logprobs"], reference["logprobs"])),
                "drafts_accepted": int(sum(map(sum, reference["accepted"]))),
                "chosen_histogram": reference["chosen"],
            })
            if method == "vegas" and temperature == 0 and name == "data=2,model=4":
                mesh = engine.model.mesh
                # [L, B, T, H_kv, D]: the stacked layers whole, batch over data, KV heads over model
                want = NamedSharding(mesh, PartitionSpec(None, "data", None, "model", None))
                out["cache_sharded"] = all(x.sharding.is_equivalent_to(want, 5)
                                           for x in (got["state"].cache.k, got["state"].cache.v))
                hlo = got["decode"].as_text()
                out["collectives"] = sorted(set(re.findall(
                    r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-start)?\(", hlo)))
    # The layer loop a GPU runs by default (unrolled: VEGAS_SCAN_LAYERS=auto) on a mesh: greedy Vegas as on one
    # device (whose loop is the CPU's scanned one).
    options = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=40)
    reference = _run_to_end(one, batch, options)
    with mock.patch.dict(os.environ, VEGAS_SCAN_LAYERS="0"):
        unrolled = engines["data=2,model=4"]
        got = _run_to_end(unrolled, batch, options)
        out["unrolled_on_mesh"] = {"scanned": unrolled.placement.scan_layers,
                                   "drafts_accepted": int(sum(map(sum, reference["accepted"]))),
                                   **{k: got[k] == reference[k] for k in ("tokens", "accepted", "selected")}}
    # The plan counts one shard: on data=2, model=4 the 5 requests take 3 rows of each data shard and a quarter of
    # the KV heads.
    import jax.numpy as jnp
    import numpy as np

    plan_options = dataclasses.replace(GREEDY, method="vegas")
    one_cache = one.plan(batch, plan_options)["bytes_per_device"]["kv_cache"]
    out["kv_cache_per_device_ratio"] = (engines["data=2,model=4"].plan(batch, plan_options)["bytes_per_device"]
                                        ["kv_cache"] / one_cache)
    # Scoring: batches split over data, heads over model; the same log-probabilities as one device.
    continuations = prompts([9, 17, 4, 12, 20], loaded.config.vocab_size, seed=6)
    one_scored = one.score(batch, continuations, batch_size=4, prefill_chunk=32)
    mesh_scored = engines["data=2,model=4"].score(batch, continuations, batch_size=4, prefill_chunk=32)
    out["score_identical"] = [bool(np.allclose(a.logprobs, b.logprobs, atol=1e-5)) and a.greedy == b.greedy
                              for a, b in zip(one_scored, mesh_scored)]

    # The int4 drafts made on one device and moved to the mesh with the model (LoadedModel.on_mesh) are the ones
    # made on the mesh, array for array and shard for shard.
    mesh_made = engines["data=2,model=4"].model.drafts["int4"]
    moved = one.model.on_mesh(engines["data=2,model=4"].model.mesh).drafts["int4"]
    out["draft_weights_move_to_a_mesh"] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
                          and a.sharding.is_equivalent_to(b.sharding, a.ndim)), moved, mesh_made)))
    # Orbax: a one-device checkpoint restores onto a mesh as the HF loader places the same model there.
    import tempfile

    from vegas_jax.loading.hf import load_hf
    from vegas_jax.loading.orbax_ckpt import load_orbax, save_orbax

    with tempfile.TemporaryDirectory() as folder:
        save_orbax(load_hf(FIXTURES / "tiny-llama", jnp.float32), folder)
        restored = load_orbax(folder, jnp.float32, make_mesh({"data": 4, "model": 2}))
    placed = load_hf(FIXTURES / "tiny-llama", jnp.float32, make_mesh({"data": 4, "model": 2}))
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))
                                          and a.sharding.is_equivalent_to(b.sharding, a.ndim)),
                        restored.params, placed.params)
    out["orbax_on_mesh_equals_hf_on_mesh"] = all(jax.tree.leaves(same))
    with tempfile.TemporaryDirectory() as folder:  # and written from the mesh, it is the one-device layout again
        save_orbax(placed, folder)
        back = load_orbax(folder, jnp.float32)
    one_device = load_hf(FIXTURES / "tiny-llama", jnp.float32)
    out["orbax_from_mesh_equals_one_device"] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), back.params, one_device.params)))
    # Continuous batching on a data-parallel mesh of four of the devices.
    serve_batch = prompts([45, 12, 80, 7, 33, 60, 21, 50, 9], loaded.config.vocab_size, seed=3)
    options = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=32)
    data4 = Engine(loaded.on_mesh(make_mesh({"data": 4, "model": 1}, jax.devices()[:4])))
    served = data4.serve(serve_batch, options, slots=4, refill=2)
    alone = one.serve(serve_batch, options, slots=4, refill=2)
    out["serve_identical"] = [a.tokens == b.tokens for a, b in zip(served.requests, alone.requests)]
    out["serve_calls"] = len(served.metrics["decode_calls"])
    return out


def scenario_nsa() -> dict:
    """The tiny Qwen3 with NSA attention (2 selected blocks of 16 and a 16-token window, so the prompts are
    sparse): plain decoding and greedy n-gram tree speculation on (data=2, model=4), its NSA caches split like
    dense ones, against one device's plain decoding."""
    import jax
    import jax.numpy as jnp

    from models.config import NSALayout
    from models.decoder import init_params
    from tests.test_lossless_tiny import GREEDY, prompts, scale_weight_matrices
    from vegas_jax.runtime.engine import Engine
    from vegas_jax.loading.bundle import LoadedModel
    from vegas_jax.sharding import make_mesh

    dense = _tiny_qwen3()
    config = dataclasses.replace(dense.config, attention="nsa", nsa=NSALayout(16, 16, 16, 2, 16, 0, 1))
    params = scale_weight_matrices(init_params(config, jnp.float32, 0), 6.0)
    nsa = LoadedModel(config, params, dense.tokenizer, "random", "random")
    batch = prompts([45, 12, 80, 30, 64], config.vocab_size, seed=5)
    options = dataclasses.replace(GREEDY, max_new_tokens=24)
    one = Engine(nsa).generate(batch, options)
    on_mesh = Engine(nsa.on_mesh(make_mesh({"data": 2, "model": 4})))
    mesh = on_mesh.generate(batch, options)
    # A greedy n-gram tree on the mesh: NSA tree verification over each shard's KV heads, the path committed.
    tree = on_mesh.generate(batch, dataclasses.replace(options, draft_tree="2x2", drafter="ngram", gamma=2))
    return {"nsa_identical": [a.tokens == b.tokens for a, b in zip(mesh.requests, one.requests)],
            "tree_identical": [a.tokens == b.tokens for a, b in zip(tree.requests, one.requests)],
            "tree_tau": tree.metrics["tau"]}


def scenario_smollm2() -> dict:
    """The real model on data=2, model=3 (SmolLM2's 3 KV heads split over 3 devices), float32, a long real prompt;
    plus the CLI's answers to bad meshes."""
    import textwrap

    import jax.numpy as jnp

    from vegas_jax.runtime.engine import Engine, GenerationOptions
    from vegas_jax.generate import main
    from vegas_jax.loading import load_model
    from vegas_jax.sharding import make_mesh

    one = Engine(load_model(None, jnp.float32))
    mesh = Engine(load_model(None, jnp.float32, make_mesh({"data": 2, "model": 3})))
    code = one.tokenizer.encode(open(textwrap.__file__, encoding="utf-8").read())[:700]
    question = one.tokenizer.encode_chat([{"role": "user", "content": "What does textwrap.dedent do?"}])
    batch = [code, question]
    out = {}
    # Greedy only: the tiny scenario runs sampled Vegas (with every generation control) on meshes, and a second
    # real-model loop would double this test's time.
    options = GenerationOptions(method="vegas", max_new_tokens=32, min_sparse_tokens=32, max_model_len=768,
                                prefill_chunk=1024)
    a = one.generate(batch, options, steps_per_call=None)
    b = mesh.generate(batch, options, steps_per_call=None)
    out["greedy"] = {"identical": [x.tokens == y.tokens for x, y in zip(a.requests, b.requests)],
                     "lengths": [len(x.tokens) for x in a.requests], "tau": a.metrics["tau"]}
    bad = {}
    for flag in ("data=2,model=2", "data=3,model=2", "data=2,modle=3", "data=2,model=3,data=1"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["--mesh", flag, "--prompt", "hi", "--quiet"])
        bad[flag] = {"code": code, "stderr": err.getvalue()}
    out["bad_meshes"] = bad
    return out


def scenario_head() -> dict:
    """A trained draft head (vegas_jax.train_draft_head, on one device) drafting on meshes: greedy chains on
    (data=4, model=2), sampled trees on (data=2, model=4), each against one device; the head's K/V of the
    prompts, which prefill (chunks of 16) writes on each data shard, against one device's."""
    import tempfile

    import numpy as np

    from tests.test_draft_head import trained
    from tests.test_lossless_tiny import prompts
    from vegas_jax.runtime.engine import Engine, GenerationOptions
    from vegas_jax.sharding import make_mesh

    loaded = _tiny_qwen3()
    one = Engine(loaded)
    folder = tempfile.mkdtemp(prefix="head-")
    trained(one, folder)
    batch = prompts([12, 30, 9, 21, 16], loaded.config.vocab_size, seed=2)
    out = {"runs": []}
    # The second run drafts from a draft vocabulary (its readout rows whole on every device, as the LM head).
    for mesh, vocab, extra in [("data=4,model=2", 0, dict(draft_tree="4x1")),
                               ("data=2,model=4", 40, dict(draft_tree="2x2", temperature=0.8, logprobs=2))]:
        data, model = (int(part.split("=")[1]) for part in mesh.split(","))
        one.use_draft_head(folder, vocabulary=vocab)
        engine = Engine(loaded.on_mesh(make_mesh({"data": data, "model": model})), draft_head=folder,
                        draft_vocab=vocab)
        options = GenerationOptions(max_new_tokens=24, drafter="head", prefill_chunk=16, **extra)
        reference, got = _run_to_end(one, batch, options), _run_to_end(engine, batch, options)
        prompt_rows = [np.asarray(e.start(batch, options).state.drafter_state.k)[: len(batch), : max(map(len, batch))]
                       for e in (one, engine)]
        out["runs"].append({"mesh": mesh, "vocab": len(engine.draft_head.get("readout", {"tokens": []})["tokens"]),
                            **{k: got[k] == reference[k] for k in ("tokens", "accepted", "top_ids")},
                            "drafts_accepted": int(sum(map(sum, reference["accepted"]))),
                            "prompt_rows": bool(np.allclose(*prompt_rows, atol=1e-5, rtol=1e-5))})
    return out


SCENARIOS = {"tiny": scenario_tiny, "nsa": scenario_nsa, "smollm2": scenario_smollm2, "head": scenario_head}


# ---- tests --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return run_scenario("tiny", devices=8)


def test_every_mesh_decodes_as_one_device(tiny):
    """Greedy Vegas on (data=8), (data=4, model=2) and (data=2, model=4); plain decoding and Quest on (data=4,
    model=2); streaming, and sampled Vegas with penalties, min-p, logprobs and a stop id, drafting from int4 weights
    with adaptive γ, on (data=2, model=4); a sampled self-drafted 2x2 tree with logprobs and a stop id on (data=2,
    model=4); 5 requests (padded to the data axis): same tokens, same drafts accepted at
    every position, same final selections per layer and request, same logprobs and (adaptive γ) the same number of
    drafts chosen at every iteration as one device; greedy Vegas with the layers unrolled (a GPU's default) on
    (data=2, model=4) as one device."""
    assert len(tiny["runs"]) == 8 and sum(run["controls"] for run in tiny["runs"]) == 1
    assert [run["tree"] for run in tiny["runs"] if run["tree"]] == ["2x2"]
    for run in tiny["runs"]:
        assert all(run[k] for k in ("tokens", "accepted", "drafted", "selected", "logprobs", "top_ids", "chosen")), run
    # The comparison has teeth: drafts were accepted (and so selections mattered) in the speculative runs.
    assert all(run["drafts_accepted"] > 0 for run in tiny["runs"] if run["method"] != "ar" or run["tree"])
    (auto,) = [run for run in tiny["runs"] if run["controls"]]
    chosen = auto["chosen_histogram"]
    assert chosen[0] and sum(chosen[1:]), chosen  # adaptive γ ran plain steps and speculative ones
    assert tiny["draft_weights_move_to_a_mesh"]
    unrolled = tiny["unrolled_on_mesh"]  # the GPU's default layer loop, on (data=2, model=4)
    assert unrolled == {"scanned": False, "drafts_accepted": unrolled["drafts_accepted"], "tokens": True,
                        "accepted": True, "selected": True} and unrolled["drafts_accepted"] > 0, unrolled


def test_an_nsa_model_decodes_on_a_mesh_as_on_one_device():
    out = run_scenario("nsa", devices=8)
    assert out["nsa_identical"] == [True] * 5 and out["tree_identical"] == [True] * 5
    assert out["tree_tau"] > 1.0  # drafts were accepted


def test_a_draft_head_drafts_on_a_mesh_as_on_one_device():
    out = run_scenario("head", devices=8)
    assert [(run["mesh"], run["vocab"]) for run in out["runs"]] == [("data=4,model=2", 0), ("data=2,model=4", 40)]
    for run in out["runs"]:
        assert run["tokens"] and run["accepted"] and run["top_ids"] and run["drafts_accepted"] > 0, run
        assert run["prompt_rows"], run


def test_the_loop_keeps_its_layout_without_gathering(tiny):
    """After the loop the cache is still split over batch (data) and KV heads (model), and the compiled loop's only
    collectives are all-reduces (row-parallel projections, scores, the finished count): nothing is gathered."""
    assert tiny["cache_sharded"]
    assert tiny["collectives"] == ["all-reduce"]


def test_checkpoints_restore_onto_a_mesh(tiny):
    """An Orbax checkpoint (written from one device) restored onto (data=4, model=2) holds, array for array and
    shard for shard, what the HF loader places there from the same model's safetensors; written from that mesh,
    the checkpoint loads on one device as the model loaded there directly."""
    assert tiny["orbax_on_mesh_equals_hf_on_mesh"] and tiny["orbax_from_mesh_equals_one_device"]


def test_scoring_on_a_mesh_equals_one_device(tiny):
    assert tiny["score_identical"] == [True] * 5


def test_the_memory_plan_counts_one_shard(tiny):
    assert tiny["kv_cache_per_device_ratio"] == pytest.approx(3 / 5 / 4)


def test_serve_on_a_data_parallel_mesh_equals_one_device(tiny):
    assert all(tiny["serve_identical"]) and len(tiny["serve_identical"]) == 9
    assert tiny["serve_calls"] > 1  # requests were admitted into a running batch


@pytest.mark.slow
def test_smollm2_on_data2_model3_equals_one_device():
    out = run_scenario("smollm2", devices=6)
    assert out["greedy"]["identical"] == [True, True], out["greedy"]
    assert min(out["greedy"]["lengths"]) >= 16 and max(out["greedy"]["lengths"]) == 32
    assert out["greedy"]["tau"] > 2.0  # real drafts, mostly accepted
    for flag, result in out["bad_meshes"].items():
        lines = result["stderr"].strip().splitlines()
        assert result["code"] == 2 and len(lines) == 1 and lines[0].startswith("error: --mesh"), (flag, result)
    assert "KV heads" in out["bad_meshes"]["data=3,model=2"]["stderr"]
    assert "6 are available" in out["bad_meshes"]["data=2,model=2"]["stderr"]
    assert "unknown axis 'modle'" in out["bad_meshes"]["data=2,modle=3"]["stderr"]


def test_load_takes_the_cli_mesh_string_or_refuses_it_in_one_line():
    """`vegas_jax.load(mesh=...)` takes what --mesh takes; what does not fit is refused naming `mesh`, before the
    checkpoint is read."""
    import jax

    import vegas_jax
    from vegas_jax.inputs import InputError

    count = jax.device_count()
    for mesh, message in [
        (f"data={count + 1}", f"mesh data={count + 1},model=1: {count + 1} devices, but {count} are available"),
        ("data=two", "mesh 'data=two': expected axis=size pairs such as data=2,model=4"),
        (2, "mesh must be a jax.sharding.Mesh, a string such as 'data=2,model=4', or None, got 2 (int)"),
    ]:
        with pytest.raises(InputError) as e:
            vegas_jax.load(None, mesh=mesh)
        assert str(e.value).startswith(message), str(e.value)
    engine = vegas_jax.load(str(FIXTURES / "tiny-llama"), "float32", mesh=f"data={count}")
    assert dict(engine.model.mesh.shape) == {"data": count, "model": 1}


@pytest.mark.parametrize("flags,needle", [
    (["--coordinator", "127.0.0.1:1"], "error: --coordinator, --num-processes and --process-id go together"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
     "error: --process-id 2: must be in [0, --num-processes 2)"),
])
def test_bad_multi_host_flags_are_one_line(flags, needle):
    from vegas_jax.generate import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([*flags, "--prompt", "hi", "--quiet"])
    assert code == 2 and err.getvalue().strip().splitlines() == [err.getvalue().strip()]
    assert err.getvalue().startswith(needle), err.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_AGREE = """
import json, sys
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from vegas_jax.sharding import Placement, make_mesh
placement = Placement(mesh=make_mesh({"data": 4, "model": 1}))
me = jax.process_index()
print(json.dumps([placement.agreed(0.25 + me), placement.agreed(me == 1), placement.agreed(3 + me)]))
"""


def test_processes_agree_on_process_0s_pacing_and_stop():
    """Each process's own elapsed time and stop signal (SIGINT) differ; the decode calls they pace must not, or
    one process enters a program's collectives that the other never does (the hang this test stands for)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE, address, str(i)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert [json.loads(out.splitlines()[-1]) for out, _ in outs] == [[0.25, False, 3]] * 2  # Gloo prints above


def test_two_processes_on_one_global_mesh_equal_one_process(tmp_path):
    """Two processes with 4 CPU devices each run the same CLI command on a (data=4, model=2) mesh across both;
    process 0 writes the output, which equals one process on one device."""
    model = FIXTURES / "tiny-llama"
    common = ["-m", "vegas_jax.generate", "--model", str(model), "--method", "vegas", "--max-new-tokens", "24",
              "--min-sparse-tokens", "8", "--quiet", "--no-chat-template"]
    for text in ("the quick brown fox jumps over the lazy dog", "a b c d e f g", "hello world", "one two three"):
        common += ["--prompt", text]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    port = _free_port()
    logs = [(tmp_path / f"p{i}.err").open("w") for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, *common, "--mesh", "data=4,model=2", "--coordinator", f"127.0.0.1:{port}",
                          "--num-processes", "2", "--process-id", str(i), "--output-json", str(tmp_path / f"p{i}.json")],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        for i, log in enumerate(logs)
    ]
    deadline = time.monotonic() + 600
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # reported below with both processes' output
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    assert [p.returncode for p in procs] == [0, 0], "".join(
        f"\n--- process {i} (exit {p.returncode}) stderr:\n{(tmp_path / f'p{i}.err').read_text()[-3000:]}"
        for i, p in enumerate(procs))
    assert not (tmp_path / "p1.json").exists()  # only process 0 writes
    alone = subprocess.run([sys.executable, *common, "--output-json", str(tmp_path / "one.json")], cwd=ROOT,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    meshed, single = (json.loads((tmp_path / name).read_text()) for name in ("p0.json", "one.json"))
    assert [r["tokens"] for r in meshed["requests"]] == [r["tokens"] for r in single["requests"]]
    assert all(len(r["tokens"]) == 24 for r in single["requests"])
    assert meshed["metrics"]["mesh"] == {"data": 4, "model": 2}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(SCENARIOS[sys.argv[1]](), default=str))
