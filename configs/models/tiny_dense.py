"""The embedded default: a deep, narrow Llama-family model pre-trained on the embedded Shakespeare
corpus with a 2048-token sentencepiece vocabulary, sized to pre-train on 2 CPU cores in minutes.

Wide enough (d_model 192, ~7M parameters, ~27 MB in float32) that batch-1 decoding streams its
weights from memory on a CPU, as decoding does on an accelerator: a forward over 5 positions costs
~1.6 single-token steps there, against ~2.7 at d_model 128, whose weights stay in the CPU's cache
(docs/RESULTS.md, "A base whose decoding is bound by memory")."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="llama", vocab_size=2048, d_model=192, n_layers=16, n_heads=6, n_kv_heads=2, head_dim=32,
        d_ff=512, max_seq_len=256, rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
    ))
    cfg.train.update(dict(steps=400, batch_size=16, learning_rate=3e-3, warmup_steps=40, checkpoint_every=100))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
