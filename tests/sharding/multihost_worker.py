"""One process of the multi-host test (also run alone as the single-process reference).

    python multihost_worker.py OUT.json WORKDIR [COORDINATOR NUM_PROCESSES PROCESS_ID]

Runs one distillation step (train preset, mesh data=2,fsdp=2) and one greedy m2r2_spec generation
(specdec preset, mesh data=2,tensor=2) over 4 devices in all, and writes the loss, the trained
rate vector's checksum and the tokens to OUT.json (process 0 only).
"""

import json
import sys

import jax
import numpy as np

from m2r2_jax.sharding.distributed import initialize

if len(sys.argv) > 3:
    initialize(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), timeout_s=120)
jax.config.update("jax_default_matmul_precision", "highest")

from m2r2_jax.decoding.api import generate  # noqa: E402
from m2r2_jax.m2r2 import losses as L  # noqa: E402
from m2r2_jax.m2r2.config import M2R2Config  # noqa: E402
from m2r2_jax.m2r2.distill import _loss_fn  # noqa: E402
from m2r2_jax.m2r2.fast_stream import init_m2r2_params  # noqa: E402
from m2r2_jax.models.config import ModelConfig  # noqa: E402
from m2r2_jax.models.transformer import init_params  # noqa: E402
from m2r2_jax.sharding.plan import ShardingPlan  # noqa: E402
from m2r2_jax.training.config import train_section  # noqa: E402
from m2r2_jax.training.loop import train  # noqa: E402


class Batches:
    """The same global batches on every process; each process yields its own rows."""

    def __init__(self, batch, seq_len, vocab):
        self.rng = np.random.default_rng(0)
        self.shape, self.vocab = (batch, seq_len), vocab

    def __iter__(self):
        return self

    def __next__(self):
        full = self.rng.integers(0, self.vocab, self.shape).astype(np.int32)
        n = jax.process_count()
        rows = self.shape[0] // n
        return full[jax.process_index() * rows:(jax.process_index() + 1) * rows]


def main(out, workdir):
    assert jax.device_count() == 4, jax.devices()
    cfg = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=48, max_seq_len=64).validate()
    mcfg = M2R2Config(branch_layer=1, rate=2, lora_rank=4)
    base = init_params(cfg, jax.random.key(0))
    m2r2 = init_m2r2_params(cfg, mcfg, jax.random.key(1))
    trainable, rest = L.split_params(m2r2, "stream")
    tcfg = train_section()
    tcfg.update(dict(steps=1, batch_size=4, learning_rate=1e-2, warmup_steps=0, progress=False,
                     async_checkpointing=False))
    plan = ShardingPlan.from_preset("train", mesh="data=2,fsdp=2")
    result = train(tcfg, workdir, trainable, (base, rest), _loss_fn(cfg, mcfg, L.LossConfig(), 16),
                   Batches(4, 16, cfg.vocab_size), rng=jax.random.key(2), plan=plan)
    from jax.experimental import multihost_utils

    rates = np.asarray(multihost_utils.process_allgather(result.trainable["rates"]["attn"], tiled=True))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13], [20, 21]]
    gen = generate("m2r2_spec", cfg, base, prompts, max_new_tokens=8, m2r2=(mcfg, m2r2), batch_size=4,
                   plan=ShardingPlan.from_preset("specdec", mesh="data=2,tensor=2"))
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"loss": result.history[0]["loss"], "rates_sum": float(np.sum(rates)),
                       "tokens": [r.tokens for r in gen], "processes": jax.process_count()}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
