"""A tiny OLMoE-family MoE (64 experts, top-8, q/k norms, routing weights not renormalised) on the
embedded corpus: the fine-grained counterpart of tiny_moe.py (8 experts, top-2) for the MoE ahead-of-time
loading experiments, with the same active expert width per token (8 x 48 = 2 x 192) and the same
balance-loss recipe. Not part of the demo; trace it with OLMoE-1B-7B costs and 16 cache slots
(2 x active), e.g.
  m2r2 pretrain --config=configs/models/tiny_olmoe.py --config.data.tokenizer=TOK --workdir=W
  m2r2 distill --config=configs/m2r2/tiny_moe.py --config.base_checkpoint=W/model --workdir=D
  m2r2 moe-bench --checkpoint W/model --m2r2 D/m2r2 --shapes olmoe-1b-7b,mixtral-8x7b --capacity 16 ...
Measured results are in docs/RESULTS.md ("Many small experts, on the balanced recipe")."""

from m2r2_jax.training.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(dict(
        family="olmoe", vocab_size=2048, d_model=128, n_layers=8, n_heads=4, n_kv_heads=4, head_dim=32,
        d_ff=0, n_experts=64, n_experts_per_tok=8, moe_d_ff=48, norm_topk_prob=False, qk_norm=True,
        max_seq_len=256, rms_eps=1e-5, rope_theta=10000.0, tie_embeddings=False,
    ))
    cfg.train.update(dict(steps=120, batch_size=8, learning_rate=3e-3, warmup_steps=12, checkpoint_every=60,
                          moe_aux_loss_coef=0.1))
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
