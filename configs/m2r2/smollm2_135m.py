"""M2R2 for SmolLM2-135M-Instruct (30 layers, d_model 576, vocabulary 49,152) on a CPU.

    m2r2 fetch smollm2-135m-instruct --out models/
    m2r2 convert --gguf models/smollm2-135m-instruct.Q4_1.gguf --out ckpt/smollm2
    m2r2 distill-data --checkpoint ckpt/smollm2 --out data/smollm2_answers.jsonl   # the base's own answers
    m2r2 distill --config=configs/m2r2/smollm2_135m.py --config.base_checkpoint=ckpt/smollm2 \
        --config.data.paths="('data/smollm2_answers.jsonl',)" --workdir runs/smollm2_m2r2

Shape: branch after 2 layers, rate 4 -> 7 fast steps (visiting layers 6, 10, ..., 30), LoRA rank 32
on every projection. On this base the slow stream's own early layers hardly agree with its output
(5-6% of tokens after 2-8 layers, 22% after 20), so the fast stream has to learn nearly all of the
work; with the tiny recipe's shape (b 2, rate 7, 4 steps, rank 8) it reached 26% agreement after
60 steps on Shakespeare, so this recipe gives it more steps and rank and trains on the text it will
draft: the base's answers to instruction prompts (chat template applied; self_instruct, koala,
wizardlm, never the benchmark sets).

Measured on the 2-core CPU (2026-12-05; the fast stream shipped in
m2r2_jax/pretrained/smollm2-135m-instruct): distill-data 822 s (992 answers, 127k tokens), distill
2420 s (600 stream steps at 3.3-3.9 s, then 60 steps of a router that read the exit head's logits). Greedy agreement of fast steps 1..7 with
the base's output on the training batches rose from 0.27-0.35 (300 steps, uniform step weights) to
0.29-0.47 (600 steps, loss.step_weights "increasing"); on MT-Bench answers the last step's drafts
are accepted 29% of the time at gamma 1 (1.29 tokens per verification), which leaves m2r2_spec at
0.78x of ar and distance_spec at 0.65x (`m2r2 bench --gamma auto`, docs/RESULTS.md): on this CPU a
two-position verify costs 1.37 ar steps, so gamma 1 breaks even only above 80% acceptance.

The router (2026-12-07): reads the fast state only (`router_features="state"`: no vocabulary-wide
head per fast step, 113 MB on this base) and can give up (`router_give_up`: a token whose router
expects no later step to be safe stops its fast steps). The shipped one was trained on the frozen
stream above by the router stage alone, on the base's answers to the held-out prompts (never
trained on by the stream, so it learns how often the stream is right on new text; 218 s of data,
150 steps in 570 s):

    m2r2 distill-data --checkpoint ckpt/smollm2 --prompts data/smollm2_answers.heldout.jsonl \
        --heldout_fraction 0 --out data/smollm2_router_answers.jsonl
    m2r2 distill --config=configs/m2r2/smollm2_135m.py --config.base_checkpoint=ckpt/smollm2 \
        --config.data.paths="('data/smollm2_router_answers.jsonl',)" --config.schedule=router \
        --config.init_m2r2=runs/smollm2_m2r2/m2r2 --workdir runs/smollm2_router

(`m2r2 demo --distill` runs the two stages of this config on the distillation data instead.)

Speed on the 2-core CPU (batch 8 x 128 tokens, tiny-recipe shape, same machine and run): the plain
loop took 8.5 s a step; scoring the KL at a quarter of the positions (loss.kl_fraction) and running
the base once over the data set (teacher_cache) take it to 1.9 s (4.4x).
"""

from m2r2_jax.m2r2.distill import distill_config


def get_config():
    cfg = distill_config()
    cfg.m2r2.update(dict(branch_layer=2, rate=4, schedule="strided", lora_rank=32, lora_alpha=32.0, router_dim=32,
                         router_hidden=32, router_features="state", router_give_up=True))
    cfg.loss.update(dict(kl_fraction=0.25, step_weights="increasing"))
    cfg.teacher_cache = True
    cfg.train.update(dict(steps=600, batch_size=8, learning_rate=2e-3, warmup_steps=20, checkpoint_every=100))
    cfg.router_train.update(dict(steps=150, batch_size=8, learning_rate=3e-3, warmup_steps=6, checkpoint_every=50))
    cfg.data.update(dict(source="jsonl", paths=("data/smollm2_answers.jsonl",), text_field="text", seq_len=128))
    return cfg
