"""Qwen2-7B (Qwen/Qwen2-7B config.json): 28 layers, GQA 28/4, q/k/v biases, rope theta 1e6."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="qwen2", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
        d_ff=18944, max_seq_len=131072, rms_eps=1e-6, rope_theta=1000000.0, qkv_bias=True,
        tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16",
    ))
    cfg.data.update(dict(seq_len=4096, tokenizer="/path/to/Qwen2-7B/tokenizer.json"))
    cfg.train.update(dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000, steps=100000))
    return cfg
