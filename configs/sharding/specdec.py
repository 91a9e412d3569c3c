"""Sharding preset for serving and speculative decoding (generate, bench).

    m2r2 generate --checkpoint CKPT --m2r2 M2R2 --method m2r2_spec --sharding=configs/sharding/specdec.py \
        --mesh data=2,tensor=4 ...

Weights tensor-parallel (heads / mlp / vocab over tensor, experts over expert), the batch over
data, the KV cache over data (batch) and tensor (kv heads). `mesh` is the default when no --mesh
flag is given (-1: the rest of the devices).
"""

from m2r2_jax.sharding.presets import specdec_preset


def get_config():
    cfg = specdec_preset()
    return cfg
