"""One exception hierarchy for everything that can be wrong with a delta: each names the file, param and
reason; its class maps to a status (`http_status`): 400 corrupt or incomplete, 403 unverified
signature, 409 base-version conflict, 422 well formed but does not fit the model."""

from __future__ import annotations


class DeltaError(Exception):
    """Base of every delta error."""

    http_status = 400

    def __init__(self, reason: str, *, file: str | None = None, param: str | None = None):
        self.reason, self.file, self.param = reason, file, param
        where = ", ".join(f"{k}={v!r}" for k, v in (("file", file), ("param", param)) if v is not None)
        super().__init__(f"{reason} ({where})" if where else reason)


class CorruptDeltaError(DeltaError):
    """The delta's bytes are malformed, damaged or fail a check."""


class FormatError(CorruptDeltaError):
    """A container, header, metadata or manifest does not follow the format."""


class IntegrityError(CorruptDeltaError):
    """A hash, checksum or size does not match."""


class BoundsError(CorruptDeltaError):
    """Positions are out of range, not strictly increasing, or counts disagree."""


class LimitError(CorruptDeltaError):
    """A header or decompressed payload would exceed its allowed size (e.g. a zstd bomb)."""


class IncompleteDeltaError(CorruptDeltaError):
    """The delta is not finished: no manifest, or a file it names is missing."""


class SignatureError(DeltaError):
    """The manifest is unsigned, or its signature does not verify with any of the receiver's keys."""

    http_status = 403


class VersionError(DeltaError):
    """A base-relative delta was offered to weights at another version."""

    http_status = 409


class IncompatibleDeltaError(DeltaError):
    """The delta names params, shapes or dtypes the receiver does not have."""

    http_status = 422


class UnknownParamError(IncompatibleDeltaError):
    """A param the receiver does not have."""


class ShapeMismatchError(IncompatibleDeltaError):
    """A param's shape differs from the receiver's."""


class DtypeMismatchError(IncompatibleDeltaError):
    """A param's dtype differs from the receiver's."""


class UnknownDtypeError(IncompatibleDeltaError):
    """A dtype name this codec does not know."""


class UnknownEncodingError(IncompatibleDeltaError):
    """An encoding name this codec does not know."""
