"""Meta Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json): GQA 32/8, 128k vocabulary."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        d_ff=14336, max_seq_len=8192, rms_eps=1e-5, rope_theta=500000.0, tie_embeddings=False,
        dtype="bfloat16", param_dtype="bfloat16",
    ))
    cfg.data.update(dict(seq_len=8192, tokenizer="/path/to/Meta-Llama-3-8B/tokenizer.json"))
    cfg.train.update(dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000, steps=100000))
    return cfg
