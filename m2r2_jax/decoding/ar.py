"""Plain autoregressive decoding: one base-model forward per token (the reference every other
method is compared with)."""

from __future__ import annotations

import jax.numpy as jnp

from m2r2_jax.decoding.loop import GenState, commit, pending_positions, round_keys, write_positions
from m2r2_jax.decoding.sampling import Sampling, select
from m2r2_jax.models.config import ModelConfig
from m2r2_jax.models.transformer import forward


def ar_round(cfg: ModelConfig, sampling: Sampling, max_new: int, eos_ids: tuple[int, ...], params,
             st: GenState) -> GenState:
    """Feed the pending token, draw the next one."""
    pos = write_positions(st, pending_positions(st))
    logits, cache = forward(cfg, params, st.pending[:, None], pos[:, None], st.cache)
    nxt = select(round_keys(st.keys, st.it + 1), logits[:, 0], sampling)
    active = (~st.done).astype(jnp.float32)
    st = st._replace(cache=cache, target_layers=st.target_layers + active * cfg.n_layers)
    one = jnp.ones_like(nxt)
    return commit(st, nxt[:, None], one, one, max_new=max_new, eos_ids=eos_ids)
