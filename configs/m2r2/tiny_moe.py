"""M2R2 distillation for the embedded tiny MoE model (configs/models/tiny_moe.py).

At MoE layers the fast stream runs a low-rank dense MLP (d -> 64 -> d) instead of routed experts.
With "experts" the fast pass demands its own top-k experts before the slow layers run: those loads
share the link with the slow stream's and block the fast pass, and in the simulated ladder they made
m2r2 the slowest prefetching rung on every platform. Measured on the aux-loss tiny MoE (50 steps)
with a teacher-forced held-out trace, "lowrank" gave m2r2's best simulated speedups of the three
options on three of the four platforms (within 0.5% of "experts" on PCIe Gen4) and its only lead
over next_gate (NVLink-C2C; both still below on-demand LRU there), with recall above next_gate at
lookahead 2 and 3; "none" costs nothing but predicted less well. The expert prediction for
ahead-of-time loading is unchanged: the fast stream's own router logits at the layers it visits,
and the routers applied to its states elsewhere.

loss.lambda_routing = 10 distils the slow stream's routing into the fast stream's own router at the
layers it visits (KL per step). Measured on the demo's artifacts (30 stream steps, 3 held-out prompts
x 96 teacher-forced tokens): m2r2 recall 0.785 -> 0.812 (after the branch 0.83 -> 0.86), at
lookahead 2 / 4 0.66 / 0.75 -> 0.73 / 0.94; 30 gave the same, 1 changed nothing.
loss.routing_layers = "predicted" (the default) extends that term to the layers no fast step visits,
through each one's router on the fast state standing for its input. Measured on run AH's MoE base
with the demo's budget, seeds 0 / 1: m2r2 recall 0.885 / 0.883 -> 0.903 / 0.902; the layer guessed
3 layers ahead 0.885 (a tie with next_gate@3: calibration had fallen back to the branch state) ->
0.991 / 0.988. On the balance-trained base (configs/models/tiny_moe.py) the demo distils 90 stream
steps instead of 30: recall after the branch 0.840 / 0.843 -> 0.889 / 0.891 (next_gate, at lead 1:
0.892); 150 steps gave 0.907 with the same simulated speedups.
"""

from m2r2_jax.m2r2.distill import distill_config


def get_config():
    cfg = distill_config()
    cfg.m2r2.update(dict(branch_layer=1, rate=2, schedule="strided", lora_rank=8, lora_alpha=16.0,
                         router_dim=32, router_hidden=32, moe_fast_mlp="lowrank", moe_lowrank_dim=64))
    cfg.train.update(dict(steps=200, batch_size=8, learning_rate=3e-3))
    cfg.router_train.update(dict(steps=60, batch_size=8, learning_rate=3e-3))
    cfg.loss.lambda_routing = 10.0
    cfg.data.update(dict(source="embedded", seq_len=128))
    return cfg
