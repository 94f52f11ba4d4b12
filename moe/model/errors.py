"""The error the model readers raise: a checkpoint that cannot be served as it is."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as is; the message names the file, field or tensor to fix."""
