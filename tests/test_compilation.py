"""The decode compiler options: applied per compilation, and an XLA that lacks one still compiles (with a warning)."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.runtime import compilation


def test_unknown_option_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(compilation, "compiler_options", lambda: {"xla_no_such_option_for_this_test": True})
    with pytest.warns(RuntimeWarning, match="xla_no_such_option_for_this_test"):
        compiled = compilation.compile_jitted(lambda x: x * 2 + 1, jnp.arange(4.0))
    np.testing.assert_array_equal(compiled(jnp.arange(4.0)), [1.0, 3.0, 5.0, 7.0])


def test_gpu_options_are_options_this_xla_knows(monkeypatch):
    # An option XLA does not know would fall back with a warning (previous test); here that is an error.
    monkeypatch.setattr(compilation, "compiler_options", lambda: dict(compilation.GPU_COMPILER_OPTIONS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = compilation.compile_jitted(lambda x: x @ x.T, jnp.ones((3, 2)))
    np.testing.assert_array_equal(compiled(jnp.ones((3, 2))), np.full((3, 3), 2.0))


def test_donated_argument_is_consumed():
    compiled = compilation.compile_jitted(lambda x: x + 1, jnp.zeros(8), donate=(0,))
    x = jnp.zeros(8)
    compiled(x)
    assert x.is_deleted()
