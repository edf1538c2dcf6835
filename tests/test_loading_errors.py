"""Broken or unsupported checkpoints fail with an error that names the file (and tensor or field) at fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file, save_file

from models.config import UnsupportedModelError
from vegas_jax.loading import CheckpointError, load_model
from vegas_jax.loading.hf import load_hf
from vegas_jax.loading.orbax_ckpt import load_orbax

FIXTURES = Path(__file__).parent / "fixtures"


def copy_fixture(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope.*no such file"):
        load_model(str(tmp_path / "nope"))


@pytest.mark.parametrize("entry", [None, "weights.bin"])
def test_path_that_is_no_known_format(tmp_path, entry):
    target = tmp_path / "folder"
    target.mkdir()
    if entry:
        target = target / entry
        target.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"{target.name}.*not a GGUF file.*Hugging Face folder.*Orbax"):
        load_model(target)


def test_missing_config_json(tmp_path):
    folder = copy_fixture("tiny-qwen2", tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: no such file"):
        load_hf(folder)


def test_unknown_model_type_is_named(tmp_path):
    folder = copy_fixture("tiny-qwen2", tmp_path)
    edit_json(folder / "config.json", model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*GPTNeoXForCausalLM.*gpt_neox"):
        load_model(folder)


def test_unsupported_rope_scaling_is_named(tmp_path):
    folder = copy_fixture("tiny-llama", tmp_path)
    edit_json(folder / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0})
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*rope_scaling.*'yarn'"):
        load_model(folder)


@pytest.mark.parametrize(
    "name, file", [("tiny-qwen2", "model.safetensors"), ("tiny-llama", "model-00002-of-00003.safetensors")]
)
def test_truncated_safetensors_names_the_file(tmp_path, name, file):
    path = copy_fixture(name, tmp_path) / file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{file}: unreadable safetensors file"):
        load_model(path.parent)


def test_missing_tensor_is_named(tmp_path):
    folder = copy_fixture("tiny-qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, folder / "model.safetensors")
    expected = r"model\.safetensors: missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"
    with pytest.raises(CheckpointError, match=expected):
        load_model(folder)


def test_tensor_missing_from_the_index_is_named(tmp_path):
    folder = copy_fixture("tiny-llama", tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]  # untied: the head is required
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: missing tensor 'lm_head\.weight'"):
        load_model(folder)


def test_shard_lacking_an_indexed_tensor_is_named(tmp_path):
    folder = copy_fixture("tiny-llama", tmp_path)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / weight_map["model.norm.weight"]
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: missing tensor 'model\.norm\.weight'"):
        load_model(folder)


def test_unexpected_tensor_is_named(tmp_path):
    folder = copy_fixture("tiny-qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra_"):
        load_model(folder)


def test_shape_disagreeing_with_config_is_named(tmp_path):
    folder = copy_fixture("tiny-qwen3", tmp_path)
    edit_json(folder / "config.json", intermediate_size=80)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.\w+' has"):
        load_model(folder)


def test_orbax_checkpoint_of_another_format_version_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "vegas_config.json").write_text(json.dumps({"format": "vegas-jax-orbax", "format_version": 99}))
    with pytest.raises(CheckpointError, match=r"vegas_config\.json: format_version 99"):
        load_orbax(folder, jnp.float32)
