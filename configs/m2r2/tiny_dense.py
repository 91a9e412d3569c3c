"""M2R2 distillation for the embedded tiny dense model (configs/models/tiny_dense.py).

    m2r2 distill --config=configs/m2r2/tiny_dense.py --config.base_checkpoint=runs/pretrain/model --workdir DIR
"""

from m2r2_jax.m2r2.distill import distill_config


def get_config():
    cfg = distill_config()
    cfg.m2r2.update(dict(branch_layer=2, rate=7, schedule="strided", lora_rank=8, lora_alpha=16.0,
                         router_dim=32, router_hidden=32))
    cfg.train.update(dict(steps=300, batch_size=8, learning_rate=3e-3))
    cfg.router_train.update(dict(steps=100, batch_size=8, learning_rate=3e-3))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
