"""M2R2 for Gemma 3 270M (pretrained; 18 layers, d_model 640, vocabulary 262,144) on a CPU.

    m2r2 fetch gemma3-270m --out models/          # the Gemma Terms of Use apply to the model
    m2r2 convert --gguf models/gemma-3-270m-q4_k_m.gguf --out ckpt/gemma3
    m2r2 distill-data --checkpoint ckpt/gemma3 --out data/gemma3_answers.jsonl --max_prompts 120 \
        --max_new_tokens 128
    m2r2 draft-vocab --checkpoint ckpt/gemma3 --corpus data/gemma3_answers.jsonl --size 8192 \
        --out data/gemma3_draft_vocab.json
    m2r2 distill --config=configs/m2r2/gemma3_270m.py --config.base_checkpoint=ckpt/gemma3 \
        --config.data.paths="('data/gemma3_answers.jsonl',)" --config.draft_vocab=data/gemma3_draft_vocab.json \
        --workdir runs/gemma3_m2r2

Shape: branch after 3 layers, rate 3 -> 5 fast steps visiting layers 6, 9, 12, 15 and 18 (1-based).
Gemma 3 alternates five sliding-window (512-token) layers with one global layer (6, 12, 18); this
stride puts every global layer on the fast stream's path, so each draft step that reads the shared
KV cache past the window reads it through a global layer, as the slow stream does, and the two
local steps in between cost what a local layer costs. LoRA rank 32 on every projection, as for
SmolLM2 (where rank 8 and 4 steps learned too little).

The vocabulary is most of the model (168M of 268M weights are the tied embedding and head): the
draft's head has to be a draft vocabulary (`m2r2 draft-vocab`), and the fast stream is distilled
for that head (`draft_vocab`: the KL over those 8,192 tokens, 32x less head work than over
262,144), at a quarter of the positions (loss.kl_fraction). The teacher cache holds hidden states,
not logits, so its size does not grow with the vocabulary.

Measured on the 2-core CPU (2026-12-07): distill-data 925 s (350 answers, 68,019 tokens of which
44,130 generated; 65 prompts held out). This is the pretrained model, which has no chat template:
prompts go in raw, and its greedy answers often repeat a sentence until the token limit (a base
that loops flatters every drafter: `m2r2 bench` prints the distinct-token fraction of ar's
answers). The answers use fewer than 8,192 distinct tokens, so the draft vocabulary covers all of
them. distill 2,172 s: 600 stream steps at ~3.1 s (331 training tokens/s; over the full
vocabulary a step takes ~17 s, 59 tokens/s, in an 8-step run of each), 30 router steps at ~9 s.
Agreement of fast steps 1..5 with the base on the last training batches, within the draft
vocabulary: 0.42 / 0.45 / 0.71 / 0.74 / 0.76.
"""

from m2r2_jax.m2r2.distill import distill_config


def get_config():
    cfg = distill_config()
    cfg.m2r2.update(dict(branch_layer=3, rate=3, schedule="strided", lora_rank=32, lora_alpha=32.0, router_dim=32,
                         router_hidden=32))
    cfg.loss.update(dict(kl_fraction=0.25, step_weights="increasing"))
    cfg.teacher_cache = True
    cfg.draft_vocab = "data/gemma3_draft_vocab.json"
    cfg.train.update(dict(steps=600, batch_size=8, learning_rate=2e-3, warmup_steps=20, checkpoint_every=100))
    cfg.router_train.update(dict(steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=3, checkpoint_every=30))
    cfg.data.update(dict(source="jsonl", paths=("data/gemma3_answers.jsonl",), text_field="text", seq_len=128))
    return cfg
