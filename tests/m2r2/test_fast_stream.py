"""Fast stream: schedules, shapes, train/decode equivalence, shared KV cache, frozen base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from m2r2_jax.errors import ConfigError
from m2r2_jax.m2r2 import fast_stream as F
from m2r2_jax.m2r2.config import M2R2Config
from m2r2_jax.models import transformer as T


def _setup(family="llama", n_layers=6, **m):
    base = tiny_config(family, n_layers=n_layers)
    bp = T.init_params(base, jax.random.key(0))
    mcfg = M2R2Config(**{"branch_layer": 1, "rate": 2, "lora_rank": 4, "router_dim": 8, "router_hidden": 8, **m})
    mp = F.init_m2r2_params(base, mcfg, jax.random.key(1))
    # non-zero adapters so that they matter in every test
    mp["adapters"] = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape), mp["adapters"])
    return base, bp, mcfg, mp


def test_schedules():
    base = tiny_config("llama", n_layers=8)
    assert F.visited_layers(base, M2R2Config(branch_layer=2, rate=2)) == (3, 5, 7)
    assert F.layers_covered(base, M2R2Config(branch_layer=2, rate=2)) == (2, 2, 2)
    # last step covers the remainder
    assert F.visited_layers(base, M2R2Config(branch_layer=1, rate=3)) == (3, 6, 7)
    assert F.layers_covered(base, M2R2Config(branch_layer=1, rate=3)) == (3, 3, 1)
    assert F.visited_layers(base, M2R2Config(branch_layer=5, schedule="consecutive")) == (5, 6, 7)
    assert F.layers_covered(base, M2R2Config(branch_layer=5, schedule="consecutive")) == (1, 1, 1)


@pytest.mark.parametrize("bad, field", [
    (dict(branch_layer=8), "branch_layer"), (dict(branch_layer=-1), "branch_layer"), (dict(rate=1), "rate"),
    (dict(lora_rank=0), "lora_rank"), (dict(schedule="fast"), "schedule"), (dict(n_steps=2, rate=2), "n_steps"),
    (dict(lora_targets=("q_proj", "w9")), "lora_targets"), (dict(moe_fast_mlp="x"), "moe_fast_mlp"),
    (dict(router_features="head"), "router_features"),
])
def test_config_validation_names_field(bad, field):
    base = tiny_config("llama", n_layers=8)
    with pytest.raises(ConfigError, match=f"m2r2.{field}="):
        M2R2Config(**bad).validate(base)


def test_rates_initialised_to_layers_covered():
    base, _, mcfg, mp = _setup()
    np.testing.assert_array_equal(mp["rates"]["attn"][:, 0], np.asarray(F.layers_covered(base, mcfg), np.float32))
    assert all(float(jnp.abs(a["B"]).max()) > 0 for a in mp["adapters"].values())
    fresh = F.init_m2r2_params(base, mcfg, jax.random.key(3))
    assert all(float(jnp.abs(a["B"]).max()) == 0 for a in fresh["adapters"].values())


@pytest.mark.parametrize("family, schedule", [
    ("llama", "strided"), ("llama", "consecutive"), ("mixtral", "strided"), ("qwen2_moe", "consecutive")])
def test_train_mode_equals_decode_mode(family, schedule):
    """The fast state at position t is the same whether computed over a whole sequence (train
    mode, context from the slow pass) or token by token against the slow KV cache (decode mode)."""
    base, bp, mcfg, mp = _setup(family, schedule=schedule)
    k = mcfg.steps(base)
    toks = jax.random.randint(jax.random.key(4), (2, 7), 0, base.vocab_size)
    tf = F.train_forward(base, mcfg, bp, mp, toks)
    assert tf.states.shape == (k, 2, 7, base.d_model)
    cache = T.init_cache(base, 2, 16)
    _, cache = T.forward(base, bp, toks[:, :6], jnp.broadcast_to(jnp.arange(6), (2, 6)), cache)
    out = F.fast_forward(base, mcfg, bp, mp, toks[:, 6:], jnp.full((2, 1), 6), cache, collect=True)
    np.testing.assert_allclose(out.states[:, :, 0], tf.states[:, :, 6], atol=2e-5)
    assert out.logits.shape == (2, 1, base.vocab_size) and out.exit_logits.shape == (k, 2, 1)
    assert out.step_logits.shape == (k, 2, 1, base.vocab_size)
    if base.is_moe:
        assert out.moe_router_logits.shape == (k, 2, 1, base.n_experts)
    # non-collecting pass agrees on the last step
    out2 = F.fast_forward(base, mcfg, bp, mp, toks[:, 6:], jnp.full((2, 1), 6), cache)
    np.testing.assert_allclose(out2.logits, out.logits, atol=1e-5)
    np.testing.assert_allclose(out2.exit_logits[-1], out.exit_logits[-1], atol=1e-5)


def test_fast_step_loop_equals_scan():
    base, bp, mcfg, mp = _setup()
    toks = jax.random.randint(jax.random.key(5), (1, 5), 0, base.vocab_size)
    cache = T.init_cache(base, 1, 8)
    _, cache = T.forward(base, bp, toks[:, :4], jnp.arange(4)[None], cache)
    pos = jnp.full((1, 1), 4)
    ref = F.fast_forward(base, mcfg, bp, mp, toks[:, 4:], pos, cache, collect=True)
    g, c = F.branch(base, mcfg, bp, toks[:, 4:], pos, cache)
    traj = F.init_traj(base, mcfg, 1, 1)
    step = jax.jit(lambda i, g, c, traj: F.fast_step(base, mcfg, bp, mp, i, g, pos, c, traj))
    for i in range(mcfg.steps(base)):
        g, c, traj, el, logits = step(jnp.int32(i), g, c, traj)
        np.testing.assert_allclose(g, ref.states[i], atol=1e-5)
        np.testing.assert_allclose(el, ref.exit_logits[i], atol=1e-4)
        np.testing.assert_allclose(logits, F.exit_head_logits(base, mcfg, bp, mp, i, g), atol=1e-5)
    np.testing.assert_array_equal(c["k"], ref.cache["k"])


def test_shared_kv_cache_writes_only_visited_layers():
    """Shared layers get exact K/V, visited layers provisional fast K/V, the rest is untouched;
    a slow pass over the same position overwrites every provisional entry."""
    base, bp, mcfg, mp = _setup(n_layers=8, branch_layer=2, rate=2)
    toks = jax.random.randint(jax.random.key(6), (1, 4), 0, base.vocab_size)
    cache = T.init_cache(base, 1, 8)
    _, cache = T.forward(base, bp, toks[:, :3], jnp.arange(3)[None], cache)
    pos = jnp.full((1, 1), 3)
    out = F.fast_forward(base, mcfg, bp, mp, toks[:, 3:], pos, cache)
    _, slow_cache = T.forward(base, bp, toks[:, 3:], pos, cache)
    written = np.asarray(jnp.abs(out.cache["k"][:, 0, :, 3]).sum(axis=(-1, -2)) > 0)
    visited = set(F.visited_layers(base, mcfg))
    expected = [l < 2 or l in visited for l in range(8)]
    assert written.tolist() == expected
    # exact where shared, different (provisional) where visited
    np.testing.assert_array_equal(out.cache["k"][:2, 0, :, 3], slow_cache["k"][:2, 0, :, 3])
    assert not np.allclose(out.cache["k"][3, 0, :, 3], slow_cache["k"][3, 0, :, 3])
    # earlier positions untouched
    np.testing.assert_array_equal(out.cache["k"][:, :, :, :3], cache["k"][:, :, :, :3])
    _, verified = T.forward(base, bp, toks[:, 3:], pos, out.cache)
    np.testing.assert_array_equal(verified["k"], slow_cache["k"])


def test_zero_extra_kv_memory():
    """The fast pass returns the very cache it was given (same tree, shapes, dtypes: no second
    cache), and compiled with the cache donated it needs no more scratch memory than one plain
    decode step of the base model."""
    base, bp, mcfg, mp = _setup(n_layers=6)
    cache = T.init_cache(base, 2, 64)
    toks = jnp.zeros((2, 1), jnp.int32)
    pos = jnp.full((2, 1), 5)
    out = F.fast_forward(base, mcfg, bp, mp, toks, pos, cache)
    assert jax.tree.structure(out.cache) == jax.tree.structure(cache)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out.cache) == jax.tree.map(lambda a: (a.shape, a.dtype), cache)

    fast = jax.jit(lambda c: F.fast_forward(base, mcfg, bp, mp, toks, pos, c).cache, donate_argnums=0)
    slow = jax.jit(lambda c: T.forward(base, bp, toks, pos, c)[1], donate_argnums=0)
    mf = fast.lower(cache).compile().memory_analysis()
    ms = slow.lower(cache).compile().memory_analysis()
    cache_bytes = sum(a.nbytes for a in jax.tree.leaves(cache))
    assert cache_bytes <= mf.output_size_in_bytes <= cache_bytes + 64  # + tuple bookkeeping
    assert mf.output_size_in_bytes == ms.output_size_in_bytes
    layer_cache = cache_bytes // base.n_layers
    assert mf.temp_size_in_bytes <= ms.temp_size_in_bytes + layer_cache // 4, (mf.temp_size_in_bytes, ms.temp_size_in_bytes)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_distill_gradients_reach_only_m2r2_params(family):
    from m2r2_jax.m2r2 import losses as L

    base, bp, mcfg, mp = _setup(family)
    toks = jax.random.randint(jax.random.key(7), (2, 8), 0, base.vocab_size)
    lc = L.LossConfig()
    grads = jax.grad(lambda p: L.distill_loss(base, mcfg, lc, bp, p, toks)[0])(mp)
    norms = {k: float(sum(jnp.sum(x * x) for x in jax.tree.leaves(v))) for k, v in grads.items()}
    for key in ("adapters", "rates", "router", "step_mlp", "exit_norm"):
        assert norms[key] > 0, key
    gb = jax.grad(lambda b: L.distill_loss(base, mcfg, lc, b, mp, toks)[0])(bp)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(gb))


def _np_routing_kl(slow, fast) -> float:
    """Mean over tokens of KL(softmax(slow) || softmax(fast)), in float64 NumPy."""
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    return float(np.mean(np.sum(np.exp(log_softmax(slow)) * (log_softmax(slow) - log_softmax(fast)), -1)))


def _assert_adapters_learn_it(term, mp):
    """`term(params)`'s gradient reaches the adapters, and a small step against it lowers it."""
    g = jax.grad(term)(mp)
    assert float(sum(jnp.sum(x * x) for x in jax.tree.leaves(g["adapters"]))) > 0
    norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
    stepped = jax.tree.map(lambda p, d: p - 1e-3 / norm * d, mp, g)
    assert float(term(stepped)) < float(term(mp))


def test_routing_distillation_term():
    """loss.lambda_routing adds KL(slow routing || fast stream's own routing) at the visited layers;
    its gradient reaches the stream's parameters and a step against it lowers that KL."""
    from m2r2_jax.m2r2 import losses as L

    base, bp, mcfg, mp = _setup("mixtral", moe_fast_mlp="lowrank")
    toks = jax.random.randint(jax.random.key(9), (2, 8), 0, base.vocab_size)
    off_loss, off = L.distill_loss(base, mcfg, L.LossConfig(), bp, mp, toks)
    on_loss, on = L.distill_loss(base, mcfg, L.LossConfig(lambda_routing=2.0, routing_layers="visited"), bp, mp, toks)
    assert "routing_kl" not in off and float(on["routing_kl"]) > 0 and "routing_kl_skipped" not in on
    assert float(on_loss) == pytest.approx(float(off_loss) + 2.0 * float(on["routing_kl"]), rel=1e-5)
    tf = F.train_forward(base, mcfg, bp, mp, toks)
    slow = np.asarray(tf.slow_router_logits)[list(F.visited_layers(base, mcfg))].astype(np.float64)
    fast = np.asarray(tf.moe_router_logits).astype(np.float64)

    assert float(on["routing_kl"]) == pytest.approx(_np_routing_kl(slow, fast), rel=1e-4)  # uniform weights
    visited_only = L.LossConfig(lambda_routing=1.0, routing_layers="visited")
    _assert_adapters_learn_it(lambda p: L.distill_loss(base, mcfg, visited_only, bp, p, toks)[1]["routing_kl"], mp)
    with pytest.raises(ConfigError, match="lambda_routing"):
        L.LossConfig(lambda_routing=-1.0).validate()


def test_skipped_layer_states():
    """Each layer after the branch that no fast step visits is stood for by the last fast state
    whose target is at or before its input; g_0 (the slow stream's h_b) is left out."""
    base = tiny_config("llama", n_layers=8)
    assert F.skipped_layer_states(base, M2R2Config(branch_layer=2, rate=2)) == ((4, 1), (6, 2))  # visits 3, 5, 7
    assert F.skipped_layer_states(base, M2R2Config(branch_layer=1, rate=3)) == ((4, 1), (5, 1))  # visits 3, 6, 7
    assert F.skipped_layer_states(base, M2R2Config(branch_layer=5, schedule="consecutive")) == ()
    assert [F.state_for_layer(1, (3, 6, 7), l) for l in range(1, 8)] == [0, 0, 0, 1, 1, 1, 2]


def test_routing_distillation_at_skipped_layers():
    """routing_layers="predicted" (the default) adds, for each skipped layer l after the branch,
    KL(slow routing at l || layer l's router on the fast state standing for l's input); checked
    against a NumPy computation from the raw weights. Its gradient reaches the adapters and a step
    against it lowers it; "visited" leaves it out."""
    from m2r2_jax.m2r2 import losses as L

    base, bp, mcfg, mp = _setup("mixtral", moe_fast_mlp="lowrank")  # 6 layers, visits 2, 4, 5
    assert F.skipped_layer_states(base, mcfg) == ((3, 1),)
    toks = jax.random.randint(jax.random.key(9), (2, 8), 0, base.vocab_size)
    visited_loss, visited = L.distill_loss(base, mcfg, L.LossConfig(lambda_routing=2.0, routing_layers="visited"),
                                           bp, mp, toks)
    loss, m = L.distill_loss(base, mcfg, L.LossConfig(lambda_routing=2.0), bp, mp, toks)
    assert float(m["routing_kl_skipped"]) > 0
    assert float(m["routing_kl"]) == pytest.approx(float(visited["routing_kl"]), rel=1e-6)
    assert float(loss) == pytest.approx(float(visited_loss) + 2.0 * float(m["routing_kl_skipped"]), rel=1e-5)

    tf = F.train_forward(base, mcfg, bp, mp, toks)
    g1 = np.asarray(tf.states[0], np.float64)  # g_1 stands for layer 3's input
    scale = np.asarray(bp["layers"]["mlp_norm"]["scale"][3], np.float64)
    kernel = np.asarray(bp["layers"]["mlp"]["router"]["kernel"][3], np.float64)
    fast = (g1 / np.sqrt(np.mean(g1 * g1, -1, keepdims=True) + base.rms_eps) * scale) @ kernel
    slow = np.asarray(tf.slow_router_logits[3], np.float64)

    assert float(m["routing_kl_skipped"]) == pytest.approx(_np_routing_kl(slow, fast), rel=1e-4)
    _assert_adapters_learn_it(lambda p: L.distill_loss(base, mcfg, L.LossConfig(lambda_routing=1.0), bp, p,
                                                       toks)[1]["routing_kl_skipped"], mp)
    with pytest.raises(ConfigError, match="routing_layers='all' is invalid"):
        L.LossConfig(routing_layers="all").validate()


@pytest.mark.parametrize("fast_mlp", ["lowrank", "none"])
def test_moe_fast_mlp_options(fast_mlp):
    base, bp, mcfg, mp = _setup("mixtral", moe_fast_mlp=fast_mlp)
    assert ("moe_lowrank" in mp) == (fast_mlp == "lowrank")
    toks = jax.random.randint(jax.random.key(8), (1, 5), 0, base.vocab_size)
    tf = F.train_forward(base, mcfg, bp, mp, toks)
    assert tf.moe_router_logits.shape == (mcfg.steps(base), 1, 5, base.n_experts)
    assert F.draft_cost_layers(base, mcfg) < F.draft_cost_layers(base, M2R2Config(**{**mcfg.to_dict(), "moe_fast_mlp": "experts"}))


@pytest.mark.parametrize("family, schedule", [("llama", "strided"), ("qwen2", "consecutive"), ("mixtral", "strided")])
def test_teacher_outputs_give_the_train_forward_states(family, schedule):
    """The distillation loss runs the fast stream from `teacher_outputs` (the slow pass kept to h_b,
    the targets, the final state and the visited layers' K/V): the same states, targets and
    teacher logits as the one-pass `train_forward`."""
    base, bp, mcfg, mp = _setup(family, schedule=schedule)
    toks = jax.random.randint(jax.random.key(5), (2, 9), 0, base.vocab_size)
    tf = F.train_forward(base, mcfg, bp, mp, toks)
    teacher = F.teacher_outputs(base, mcfg, bp, toks)
    vis = np.asarray(F.visited_layers(base, mcfg))
    np.testing.assert_allclose(teacher.g0, tf.g0, atol=1e-6)
    np.testing.assert_allclose(teacher.targets, tf.slow_hidden[vis + 1], atol=1e-6)
    np.testing.assert_allclose(T.head(base, bp, teacher.final), tf.slow_logits, atol=1e-5)
    np.testing.assert_allclose(F.fast_train_states(base, mcfg, bp, mp, teacher), tf.states, atol=1e-5)


def test_kl_fraction_scores_a_fresh_subset_of_positions():
    from m2r2_jax.m2r2 import losses as L

    lc = L.LossConfig(kl_fraction=0.25)
    a, b = (np.asarray(L.kl_positions(lc, 16, jax.random.key(s))) for s in (0, 1))
    assert a.shape == (4,) and np.all(np.diff(a) > 0) and 0 <= a.min() and a.max() < 16
    assert not np.array_equal(a, b)
    assert L.kl_positions(lc, 16, None) is None and L.kl_positions(L.LossConfig(), 16, jax.random.key(0)) is None
    with pytest.raises(ConfigError, match="kl_fraction"):
        L.LossConfig(kl_fraction=0.0).validate()
    # the loss at a fraction is the full loss's KL term over those positions only: with one position
    # scored, it moves with the drawn position and stays finite
    base, bp, mcfg, mp = _setup("llama")
    toks = jax.random.randint(jax.random.key(6), (2, 8), 0, base.vocab_size)
    full, _ = L.distill_loss(base, mcfg, L.LossConfig(), bp, mp, toks)
    one = [float(L.distill_loss(base, mcfg, L.LossConfig(kl_fraction=0.125), bp, mp, toks, jax.random.key(s))[0])
           for s in range(4)]
    assert all(np.isfinite(one)) and len(set(one)) > 1 and float(full) not in one


def test_draft_vocab_loss_is_the_draft_heads_own_distillation():
    """With a draft vocabulary both heads score only the subset: the KL is the one between the two
    renormalised distributions, the whole vocabulary as the subset gives the plain loss back, and
    the adapters learn through it. Deciders cannot train on it."""
    from m2r2_jax.m2r2 import losses as L

    base, bp, mcfg, mp = _setup("llama")
    toks = jax.random.randint(jax.random.key(7), (2, 8), 0, base.vocab_size)
    lc = L.LossConfig(lambda_align=0.0)

    def vocab(ids):
        ids = jnp.asarray(ids, jnp.int32)
        return {"ids": ids, "kernel": T.head_kernel_columns(base, bp, ids)}

    plain, pm = L.distill_loss(base, mcfg, lc, bp, mp, toks, deciders=False)
    whole, wm = L.distill_loss(base, mcfg, lc, bp, mp, toks, deciders=False, vocab=vocab(np.arange(base.vocab_size)))
    np.testing.assert_allclose(whole, plain, rtol=1e-5)
    np.testing.assert_allclose(wm["agreement_per_step"], pm["agreement_per_step"])

    ids = np.arange(3, base.vocab_size, 5)  # every fifth token
    loss, m = L.distill_loss(base, mcfg, lc, bp, mp, toks, deciders=False, vocab=vocab(ids))
    teacher = F.teacher_outputs(base, mcfg, bp, toks)
    states = F.fast_train_states(base, mcfg, bp, mp, teacher)
    slow = jax.nn.log_softmax(T.head(base, bp, teacher.final)[..., ids], -1)
    kls, agree = [], []
    for i in range(mcfg.steps(base)):
        fast = jax.nn.log_softmax(F.exit_head_logits(base, mcfg, bp, mp, i, states[i])[..., ids], -1)
        kls.append(jnp.mean(jnp.sum(jnp.exp(slow) * (slow - fast), -1)))
        agree.append(jnp.mean(jnp.argmax(fast, -1) == jnp.argmax(slow, -1)))
    np.testing.assert_allclose(loss, np.mean(kls), rtol=1e-5)  # uniform step weights
    np.testing.assert_allclose(m["agreement_per_step"], agree, atol=1e-6)
    assert not np.isclose(float(loss), float(plain), rtol=1e-2)  # the subset's KL is not the full one
    _assert_adapters_learn_it(lambda p: L.distill_loss(base, mcfg, lc, bp, p, toks, deciders=False,
                                                       vocab=vocab(ids))[0], mp)
    with pytest.raises(ConfigError, match="deciders"):
        L.distill_loss(base, mcfg, lc, bp, mp, toks, vocab=vocab(ids))


def test_state_router_reads_the_velocity_only_and_trains():
    """router_features="state": the router's scalars are the step's velocity alone (its input
    layer is two fewer wide), nothing of the exit head reaches its score, and its BCE trains it."""
    from m2r2_jax.m2r2 import losses as L
    from m2r2_jax.m2r2.router import step_scalars

    base, bp, mcfg, mp = _setup("llama", router_features="state")
    assert mp["router"]["mlp_in"]["kernel"].shape[0] == 2 * mcfg.router_dim + 1
    g, gp = (jax.random.normal(jax.random.key(s), (2, 3, base.d_model)) for s in (8, 9))
    np.testing.assert_allclose(step_scalars("state", None, g, gp), step_scalars("logits", g @ bp["embed"]["embedding"].T,
                                                                                   g, gp)[..., 2:], rtol=1e-6)
    toks = jax.random.randint(jax.random.key(10), (2, 8), 0, base.vocab_size)
    cache = T.init_cache(base, 2, 8)
    out = F.fast_forward(base, mcfg, bp, mp, toks, jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
    assert np.all(np.isfinite(np.asarray(out.exit_logits[-1])))
    router_loss = lambda r: L.distill_loss(base, mcfg, L.LossConfig(), bp, {**mp, "router": r}, toks)[1]["router_bce"]
    grads = jax.grad(router_loss)(mp["router"])
    assert float(sum(jnp.sum(x * x) for x in jax.tree.leaves(grads))) > 0
