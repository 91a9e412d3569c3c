"""Errors that reach the user as one clear line (the CLI prints them and exits non-zero)."""


class M2R2Error(Exception):
    """A problem with the user's input: bad config, checkpoint, data, prompt or flag."""


class ConfigError(M2R2Error, ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


class CheckpointError(M2R2Error):
    """A checkpoint is missing, corrupt or does not match what it is loaded into."""


class DataError(M2R2Error):
    """Input data (corpus, jsonl, tokens, prompts) is unusable."""


class Preempted(Exception):
    """A training stage stopped early (SIGTERM, a planned stop) with its state checkpointed: not a
    failure and not the user's input; rerunning the same command resumes from the checkpoint."""
