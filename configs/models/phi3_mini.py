"""Microsoft Phi-3-mini-4k-instruct (config.json): 32 layers, d_model 3072, MHA, sliding window 2047."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="phi3", vocab_size=32064, d_model=3072, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=96,
        d_ff=8192, max_seq_len=4096, rms_eps=1e-5, rope_theta=10000.0, sliding_window=2047,
        tie_embeddings=False, dtype="bfloat16", param_dtype="bfloat16",
    ))
    cfg.data.update(dict(seq_len=4096, tokenizer="/path/to/Phi-3-mini-4k-instruct/tokenizer.model"))
    cfg.train.update(dict(batch_size=256, learning_rate=3e-4, warmup_steps=2000, steps=100000))
    return cfg
