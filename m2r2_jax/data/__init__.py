"""Text data: the embedded corpus and its train/held-out split (`corpus`), tokenizers
(`tokenizer`), sources (`sources`: text, jsonl, tfds, embedded) and the packed, sharded,
checkpointable grain pipeline (`pipeline`). Nothing here imports TensorFlow."""
