"""OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924 config.json): 16 layers, 64 experts, top-8, q/k norms,
routing weights not renormalised over the top-k; load-balancing loss weight = its
router_aux_loss_coef (0.01)."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="olmoe", vocab_size=50304, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128,
        d_ff=0, n_experts=64, n_experts_per_tok=8, moe_d_ff=1024, norm_topk_prob=False, qk_norm=True,
        max_seq_len=4096, rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
        dtype="bfloat16", param_dtype="bfloat16",
    ))
    cfg.data.update(dict(seq_len=4096, tokenizer="/path/to/OLMoE-1B-7B-0924/tokenizer.json"))
    cfg.train.update(dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000, steps=100000,
                          moe_aux_loss_coef=0.01))
    return cfg
