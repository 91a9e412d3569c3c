"""The tied LM head's few-rows form (`layers.tied_head_product`): on CPU, 2..FEW_ROWS_MAX rows are
a broadcast multiply summed over d (faster than XLA:CPU's dot there); it equals the dot and other
platforms lower the dot (speculative decoding through it: tests/decoding/test_decoding_lossless.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m2r2_jax.models import layers


@pytest.mark.parametrize("lead", [(1,), (2,), (1, 3), (2, 2), (4,), (5,), (2, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_the_dot(few_rows_head_everywhere, lead, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=lead + (48,)), dtype)
    w = jnp.asarray(rng.normal(size=(301, 48)) / 7, jnp.float32)
    got = jax.jit(layers.tied_head_product)(x, w)
    want = jnp.einsum("...d,vd->...v", x.astype(jnp.float32), w.astype(dtype).astype(jnp.float32))
    assert got.shape == lead + (301,) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)
    rows = int(np.prod(lead))
    assert bool(few_rows_head_everywhere) == (2 <= rows <= layers.FEW_ROWS_MAX)


def _lowered(platform: str, rows: int) -> str:
    specs = (jax.ShapeDtypeStruct((rows, 64), jnp.float32), jax.ShapeDtypeStruct((1 << 16, 64), jnp.float32))
    return jax.export.export(jax.jit(layers.tied_head_product), platforms=[platform])(*specs).mlir_module()


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_only_cpu_lowers_the_broadcast_form(platform):
    assert (1 << 16) * 64 >= layers.FEW_ROWS_MIN_TABLE  # the real threshold, no fixture
    text = _lowered(platform, 3)
    assert ("dot_general" in text) == (platform != "cpu")
    assert ("stablehlo.reduce" in text) == (platform == "cpu")
    assert "dot_general" in _lowered(platform, 1)  # one row: the dot everywhere
