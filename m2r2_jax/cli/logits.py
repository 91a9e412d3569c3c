"""`m2r2 logits --checkpoint CKPT_DIR --tokens IN.npy --out OUT.npy [--dtype float32]`

Base-model logits: int32 [B, T] token ids in, float32 [B, T, V] logits out (one jitted forward
pass). The output is written atomically (temporary file + rename).
"""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("checkpoint", None, "model checkpoint directory")
flags.DEFINE_string("tokens", None, ".npy file holding int32 token ids of shape [B, T]")
flags.DEFINE_string("out", None, ".npy file to write float32 logits [B, T, V] to")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "compute dtype")
flags.mark_flags_as_required(["checkpoint", "tokens", "out"])
FLAGS = flags.FLAGS


def load_tokens(path, vocab_size: int, max_seq_len: int):
    """int32 [B, T] ids from a .npy file, checked against the model; DataError otherwise."""
    import numpy as np

    from m2r2_jax.errors import DataError

    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"tokens file {path} not found") from None
    except IsADirectoryError:
        raise DataError(f"tokens file {path} is a directory") from None
    except Exception as e:  # not .npy, pickled objects, truncated
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"tokens file {path} is not a readable .npy array: {msg}") from None
    if not isinstance(tokens, np.ndarray):
        raise DataError(f"tokens file {path} holds an archive, expected one int32 [B, T] array (.npy)")
    if tokens.dtype != np.int32:
        raise DataError(f"tokens in {path} have dtype {tokens.dtype}, expected int32 (use arr.astype(np.int32))")
    if tokens.ndim != 2:
        raise DataError(f"tokens in {path} have shape {list(tokens.shape)}, expected rank 2 [B, T]")
    if tokens.size == 0:
        raise DataError(f"tokens in {path} have shape {list(tokens.shape)}: B and T must be positive")
    if tokens.shape[1] > max_seq_len:
        raise DataError(f"tokens in {path} have T={tokens.shape[1]} > the model's max_seq_len={max_seq_len}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise DataError(f"tokens in {path} include id {bad} outside the vocabulary [0, {vocab_size})")
    return tokens


def compute_logits(cfg, params, tokens):
    """float32 [B, T, V] logits of the base model for int32 [B, T] tokens (positions 0..T-1)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from m2r2_jax.models.transformer import forward

    # float32 means float32 matmuls (TPUs default to bf16 passes, recent GPUs to TF32)
    precision = "highest" if cfg.dtype == "float32" else "default"
    with jax.default_matmul_precision(precision):
        logits, _ = jax.jit(lambda p, t: forward(cfg, p, t))(params, jnp.asarray(tokens))
    return np.asarray(logits, np.float32)


def write_npy_atomic(path, array) -> None:
    import os
    from pathlib import Path

    import numpy as np

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def main(argv):
    from pathlib import Path

    from m2r2_jax.errors import DataError
    from m2r2_jax.models.config import read_model_config

    if Path(FLAGS.out).is_dir():
        raise DataError(f"--out {FLAGS.out} is a directory; expected a .npy file path")
    cfg = read_model_config(FLAGS.checkpoint)
    tokens = load_tokens(FLAGS.tokens, cfg.vocab_size, cfg.max_seq_len)  # fail fast, before importing jax
    from m2r2_jax.models.checkpoint import load_model

    cfg, params = load_model(FLAGS.checkpoint, cfg)
    logits = compute_logits(cfg.replace(dtype=FLAGS.dtype), params, tokens)
    write_npy_atomic(FLAGS.out, logits)
    print(f"wrote {FLAGS.out}: float32 {list(logits.shape)}")
