"""A tiny Mixtral-family MoE (8 experts, top-2) on the embedded corpus, sharing tiny_dense's
tokenizer settings; the base model for the MoE ahead-of-time expert loading experiments.

Trained with the load-balancing loss at 0.1 (Mixtral uses 0.02 over a far longer run). A briefly
trained router routes most tokens to a few experts per layer, and a cache of 2 x top-k experts
then hits almost always, which no real (balance-trained) MoE does. Measured with the demo's batch
(8 x 128 tokens), as `expert_load_max` (the busiest expert's share x E: 1 = even, 4 = collapsed)
and the LRU hit rate of 4 slots on 3 held-out texts:
  50 steps at 0.02 (the demo until now): 3.1-3.9 per layer, LRU hit 0.87, held-out loss 5.71;
  50 steps at 0.1 / 0.5: 2.4-3.2 / 1.5-3.7, LRU hit 0.75 / 0.81, held-out loss 5.78 / 5.96;
  200 steps at 0.02: 1.4-2.0, LRU hit 0.57, held-out loss 4.89;
  120 steps at 0.1 (the demo now): 1.3-1.8, LRU hit 0.56, held-out loss 5.39.
Routing is skewed at the start (2.2 at step 1) and collapses further over the first ~40 steps
(3.9 at step 20) before the balance loss wins, so the steps matter more than the weight."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="mixtral", vocab_size=2048, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32,
        d_ff=0, n_experts=8, n_experts_per_tok=2, moe_d_ff=192, norm_topk_prob=True, max_seq_len=256,
        rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
    ))
    cfg.train.update(dict(steps=400, batch_size=16, learning_rate=3e-3, warmup_steps=40, checkpoint_every=100,
                          moe_aux_loss_coef=0.1))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
