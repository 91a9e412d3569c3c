"""Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, 8 experts, top-2, GQA 32/8;
load-balancing loss weight = its router_aux_loss_coef (0.02)."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="mixtral", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        d_ff=0, n_experts=8, n_experts_per_tok=2, moe_d_ff=14336, norm_topk_prob=True, max_seq_len=32768,
        rms_eps=1e-5, rope_theta=1000000.0, tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16",
    ))
    cfg.data.update(dict(seq_len=4096, tokenizer="/path/to/Mixtral-8x7B-v0.1/tokenizer.model"))
    cfg.train.update(dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000, steps=100000,
                          moe_aux_loss_coef=0.02))
    return cfg
