"""Sharding preset for training (pretrain, distill): FSDP + tensor parallelism.

    m2r2 distill --config=configs/m2r2/llama3_8b.py --sharding=configs/sharding/train.py \
        --mesh data=2,fsdp=4,tensor=2 ...

Batch over data x fsdp; weights' embed dimension over fsdp, heads / mlp / vocab over tensor,
experts over expert. The frozen base, the M2R2 parameters and the optimiser state are all
sharded. Edit `rules` here (or copy this file) to try another layout; `mesh` is the default
when no --mesh flag is given (-1: the rest of the devices).
"""

from m2r2_jax.sharding.presets import train_preset


def get_config():
    cfg = train_preset()
    return cfg
