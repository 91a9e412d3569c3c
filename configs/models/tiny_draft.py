"""A small draft model for two-model speculative decoding against tiny_dense: same family,
tokenizer settings and vocabulary (so drafts are verifiable token for token), 3 layers."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="llama", vocab_size=2048, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32,
        d_ff=352, max_seq_len=256, rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
    ))
    cfg.train.update(dict(steps=400, batch_size=16, learning_rate=3e-3, warmup_steps=40, checkpoint_every=100))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
