"""Training: configs and their validation (`config`), the generic train loop with orbax
checkpoints, exact resume and preemption handling (`loop.train`), next-token loss and evaluation
(`lm`), base-model pre-training (`pretrain`) and minimal sampling (`sampling`)."""
