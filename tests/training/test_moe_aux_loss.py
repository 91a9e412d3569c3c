"""The MoE load-balancing loss of base-model pre-training and its config field."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import tiny_config

from m2r2_jax.errors import ConfigError
from m2r2_jax.models import transformer as T
from m2r2_jax.training.config import base_config, validate_config
from m2r2_jax.training.lm import lm_loss_and_metrics, lm_loss_fn, moe_balance_loss, next_token_loss


@pytest.fixture(scope="module")
def moe():
    cfg = tiny_config("mixtral")
    params = T.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    return cfg, params, tokens


def with_router(params, kernel):
    p = jax.tree.map(lambda x: x, params)
    p["layers"]["mlp"]["router"]["kernel"] = kernel
    return p


def reference_balance(logits, k):
    """Straight from the definition, in numpy: per layer E * sum_e f_e P_e, mean over layers."""
    L, E = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(L, -1, E).astype(np.float64)
    probs = np.exp(flat - flat.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = []
    for layer in range(L):
        counts = np.zeros(E)
        for row in probs[layer]:
            counts[np.argsort(-row, kind="stable")[:k]] += 1
        f = counts / counts.sum()
        out.append(E * np.sum(f * probs[layer].mean(0)))
    return float(np.mean(out))


def test_uniform_router_gives_one(moe):
    cfg, params, tokens = moe
    zero = with_router(params, jnp.zeros_like(params["layers"]["mlp"]["router"]["kernel"]))
    _, m = lm_loss_and_metrics(cfg, zero, tokens)
    assert float(m["aux_loss"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["router_entropy"]) == pytest.approx(np.log(cfg.n_experts), abs=1e-5)
    # ties go to the lowest indices, so every token picks the same k experts: the load is collapsed
    assert float(m["expert_load_max"]) == pytest.approx(cfg.n_experts / cfg.n_experts_per_tok)


def test_collapsed_routing_is_penalised_and_matches_the_definition():
    cfg = tiny_config("mixtral")
    E, k = cfg.n_experts, cfg.n_experts_per_tok
    rng = np.random.default_rng(0)
    collapsed = np.zeros((2, 3, 5, E), np.float32)
    collapsed[..., :k] = 20.0  # every token sends (almost) all its probability to the first k experts
    aux, stats = moe_balance_loss(cfg, jnp.asarray(collapsed))
    assert float(aux) > 1.5 and float(aux) == pytest.approx(E / k, rel=1e-3)
    assert float(stats["expert_load_max"]) == pytest.approx(E / k)
    noisy = rng.normal(size=(3, 2, 7, E)).astype(np.float32)
    aux, _ = moe_balance_loss(cfg, jnp.asarray(noisy))
    assert float(aux) == pytest.approx(reference_balance(noisy, k), rel=1e-5)


def test_loss_adds_coef_times_aux_and_trains_the_router(moe):
    cfg, params, tokens = moe
    coef = 0.5
    plain, m0 = lm_loss_fn(cfg)(params, {}, tokens, None)
    lm, _ = next_token_loss(cfg, params, tokens)
    assert float(plain) == pytest.approx(float(lm), rel=1e-6)
    assert float(m0["lm_loss"]) == pytest.approx(float(lm), rel=1e-6)
    loss, m = lm_loss_fn(cfg, coef)(params, {}, tokens, None)
    assert float(loss) == pytest.approx(float(m["lm_loss"]) + coef * float(m["aux_loss"]), rel=1e-6)
    assert float(m["aux_loss"]) == pytest.approx(float(m0["aux_loss"]), rel=1e-6)

    def router_grad(c):
        g = jax.grad(lambda p: lm_loss_fn(cfg, c)(p, {}, tokens, None)[0])(params)
        return np.asarray(g["layers"]["mlp"]["router"]["kernel"])

    extra = router_grad(coef) - router_grad(0.0)
    assert np.abs(extra).max() > 1e-6  # the balance term reaches the router


def test_descending_the_balance_loss_spreads_the_load(moe):
    # The sign of the gradient: a few steps on the balance loss alone, from a router that favours
    # some experts, must lower it.
    cfg, params, tokens = moe
    kernel = params["layers"]["mlp"]["router"]["kernel"] * 30.0

    def aux_of(kern):
        return lm_loss_and_metrics(cfg, with_router(params, kern), tokens, 1.0)[1]["aux_loss"]

    before = float(aux_of(kernel))
    grad = jax.jit(jax.grad(aux_of))
    for _ in range(20):
        kernel = kernel - 0.5 * grad(kernel)
    assert before > 1.05
    assert float(aux_of(kernel)) < before - 0.05


def test_dense_models_report_no_balance_metrics():
    cfg = tiny_config("llama")
    params = T.init_params(cfg, jax.random.key(0))
    tokens = jnp.zeros((1, 5), jnp.int32)
    _, m = lm_loss_and_metrics(cfg, params, tokens)
    assert set(m) == {"accuracy"}


def moe_config(**train):
    cfg = base_config()
    cfg.model.update(dict(family="mixtral", d_ff=0, n_experts=4, n_experts_per_tok=2, moe_d_ff=64))
    cfg.train.update(train)
    return cfg


def test_config_field_is_validated():
    assert base_config().train.moe_aux_loss_coef == 0.0
    validate_config(moe_config(moe_aux_loss_coef=0.02), process_count=1)
    with pytest.raises(ConfigError, match=r"train.moe_aux_loss_coef=-0.1 is invalid: expected a number in \[0"):
        validate_config(moe_config(moe_aux_loss_coef=-0.1), process_count=1)
    as_text = moe_config().to_dict()
    as_text["train"]["moe_aux_loss_coef"] = "x"  # as a JSON config could carry it
    with pytest.raises(ConfigError, match=r"train.moe_aux_loss_coef='x' is invalid"):
        validate_config(ml_collections.ConfigDict(as_text), process_count=1)
    dense = base_config()
    dense.train.moe_aux_loss_coef = 0.01
    with pytest.raises(ConfigError, match=r"train.moe_aux_loss_coef=0.01 is invalid: .*MoE model.*n_experts=0") as e:
        validate_config(dense, process_count=1)
    assert "\n" not in str(e.value)
    validate_config(ml_collections.ConfigDict(base_config().to_dict()), process_count=1)  # 0 on dense is fine
