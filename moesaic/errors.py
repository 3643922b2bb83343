"""The errors a user can cause. Everything user-facing raises a subclass of MoesaicError."""


class MoesaicError(Exception):
    """Base of every error moesaic raises on purpose; the CLI prints these without a traceback."""


class ConfigError(MoesaicError):
    """A config.json / params.json field is missing, has an unsupported value, or contradicts another."""


class CheckpointError(MoesaicError):
    """The checkpoint's tensors do not match what the config says the model needs."""


class CapacityError(MoesaicError):
    """A request does not fit: context longer than the model allows, or more state than memory."""


class RequestError(MoesaicError):
    """A malformed request: bad sampling parameters, empty prompt, token ids out of range."""
