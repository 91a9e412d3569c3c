"""A tiny Mixtral-family MoE (8 experts, top-2) on the embedded corpus, sharing tiny_dense's
tokenizer settings; the base model for the MoE ahead-of-time expert loading experiments.

Trained with Mixtral's load-balancing loss weight (router_aux_loss_coef = 0.02): without it a
short run routes most tokens to a few experts per layer, and an expert cache then hits almost
always, which no real (balance-trained) MoE does."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="mixtral", vocab_size=2048, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32,
        d_ff=0, n_experts=8, n_experts_per_tok=2, moe_d_ff=192, norm_topk_prob=True, max_seq_len=256,
        rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
    ))
    cfg.train.update(dict(steps=400, batch_size=16, learning_rate=3e-3, warmup_steps=40, checkpoint_every=100,
                          moe_aux_loss_coef=0.02))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
