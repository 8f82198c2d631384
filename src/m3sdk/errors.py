"""The errors an application sees. Request errors are raised before anything is queued."""


class M3Error(Exception):
    """Base class of every m3sdk error."""


class InvalidRequestError(M3Error, ValueError):
    """Bad sampling parameters, an empty or too long prompt, token ids outside the vocabulary."""


class EngineOverloadedError(M3Error):
    """The bounded admission queue is full; retry later."""


class EngineDeadError(M3Error):
    """The engine thread has failed; every waiter gets this, none hangs."""


class PrefillNodeError(M3Error):
    """Remote prefill failed and local fallback is off."""


class CheckpointError(M3Error, ValueError):
    """A checkpoint cannot be loaded: missing config, unknown architecture, missing or misshapen tensors."""


class ConfigError(M3Error, ValueError):
    """The engine's configuration cannot be served on this machine (no such device, no kernels for it, no FP8
    there); raised before anything loads."""
