"""M2R2 distillation for the embedded tiny MoE model (configs/models/tiny_moe.py): the fast stream
runs the experts its own router picks, which is also the expert prediction for AoT loading."""

from m2r2_jax.m2r2.distill import distill_config


def get_config():
    cfg = distill_config()
    cfg.m2r2.update(dict(branch_layer=1, rate=2, schedule="strided", lora_rank=8, lora_alpha=16.0,
                         router_dim=32, router_hidden=32, moe_fast_mlp="experts"))
    cfg.train.update(dict(steps=200, batch_size=8, learning_rate=3e-3))
    cfg.router_train.update(dict(steps=60, batch_size=8, learning_rate=3e-3))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
