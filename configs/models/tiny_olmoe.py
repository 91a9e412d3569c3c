"""A tiny OLMoE-family MoE (64 experts, top-8, q/k norms, routing weights not renormalised) on the
embedded corpus: the fine-grained counterpart of tiny_moe.py (8 experts, top-2) for the MoE ahead-of-time
loading experiments, with the same active expert width per token (8 x 48 = 2 x 192) and the same
balance-loss recipe. Not part of the demo; trace it with OLMoE-1B-7B costs and 16 cache slots
(2 x active), e.g.
  m2r2 pretrain --config=configs/models/tiny_olmoe.py --config.data.tokenizer=TOK --workdir=W
  m2r2 distill --config=configs/m2r2/tiny_moe.py --config.base_checkpoint=W/model --workdir=D
  m2r2 moe-bench --checkpoint W/model --m2r2 D/m2r2 --shapes olmoe-1b-7b,mixtral-8x7b --capacity 16 ...
Measured results are in docs/RESULTS.md ("Many small experts, on the balanced recipe")."""

from pathlib import Path

from m2r2_jax.training.config import load_config_file


def get_config():
    # tiny_moe's corpus, attention and balance-loss recipe; OLMoE's routing shape
    cfg = load_config_file(Path(__file__).with_name("tiny_moe.py"))
    cfg.model.update(dict(family="olmoe", n_kv_heads=4, n_experts=64, n_experts_per_tok=8, moe_d_ff=48,
                          norm_topk_prob=False, qk_norm=True))
    cfg.train.update(dict(steps=120, batch_size=8, warmup_steps=12, checkpoint_every=60))
    return cfg
