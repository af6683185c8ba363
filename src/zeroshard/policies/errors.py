"""Every error zeroshard raises on purpose. Each message names the problem and the fix."""

from __future__ import annotations


class ZeroShardError(Exception):
    """Base class of zeroshard's own errors."""


class ConfigError(ZeroShardError, ValueError):
    """A configuration value is invalid, inconsistent or unknown."""


class NotSupportedYetError(ConfigError):
    """The configuration asks for a feature zeroshard accepts in the schema but has not built."""


class CommError(ZeroShardError, RuntimeError):
    """A collective failed: a peer died, disagreed, or the backend refused the call."""


class CommTimeoutError(CommError):
    """A collective waited longer than `zeroshard.comm_timeout_s`."""


class CheckpointError(ZeroShardError, RuntimeError):
    """A checkpoint is missing, damaged, or does not match the model."""


class NvmeError(ZeroShardError, RuntimeError):
    """The NVMe tier's folder is missing, unwritable, too small, or an I/O on it failed."""


class NvmeSpaceError(NvmeError):
    """The NVMe tier's disk has (or would have) too little free space."""
