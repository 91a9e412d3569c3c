"""M2R2 for Llama-3-8B (32 layers): branch after 4 layers, rate 4 -> 7 fast steps.

    m2r2 convert --hf Meta-Llama-3-8B --out ckpt/llama3_8b
    m2r2 distill --config=configs/m2r2/llama3_8b.py --config.base_checkpoint=ckpt/llama3_8b \
        --config.data.source=jsonl --config.data.paths='("data/*answers.jsonl",)' --workdir runs/llama3_8b_m2r2
"""

from m2r2_jax.m2r2.distill import distill_config


def get_config():
    cfg = distill_config()
    cfg.m2r2.update(dict(branch_layer=4, rate=4, schedule="strided", lora_rank=16, lora_alpha=32.0))
    cfg.train.update(dict(steps=20000, batch_size=64, learning_rate=1e-3, warmup_steps=500, checkpoint_every=1000))
    cfg.router_train.update(dict(steps=2000, batch_size=64, learning_rate=1e-3, warmup_steps=100))
    cfg.data.update(dict(seq_len=2048))
    return cfg
