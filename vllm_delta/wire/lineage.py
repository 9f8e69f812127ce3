"""Does an update apply on the weights an engine holds: the one rule (its version half and its run half),
called by every receiver."""

from __future__ import annotations

from .encodings import Encoding, get_encoding
from .errors import VersionError
from .manifest import Lineage, LineageError, Manifest


def check_versions(
    manifest: Manifest, *, version: int, base_version: int | None, engine_version: int
) -> Encoding:
    """The version half (`VersionError`); the delta's encoding. Nothing goes back; only overwrites replay."""
    if manifest.version != version:
        raise VersionError(f"request says version {version}, the delta is version {manifest.version}")
    if base_version is not None and base_version != engine_version:
        raise VersionError(f"base_version {base_version} != engine version {engine_version}")
    encoding = get_encoding(manifest.encoding)
    replay = version == engine_version
    if version < engine_version or (replay and not encoding.idempotent):
        raise VersionError(
            f"version {version} cannot be applied at engine version {engine_version}"
            + (" (a base-relative delta applies exactly once)" if replay else "")
        )
    return check_base(manifest, engine_version)


def check_base(manifest: Manifest, engine_version: int | None) -> Encoding:
    """A base-relative delta applies only on its base version (`engine_version` None: unknown, refused)."""
    encoding = get_encoding(manifest.encoding)
    if encoding.needs_base and engine_version != manifest.base_version:
        raise VersionError(
            f"{encoding.name!r} applies only on version {manifest.base_version}, not {engine_version}"
        )
    return encoding


def check_lineage(
    lineage: Lineage | None, *, version: int, engine_version: int, engine_run_id: str | None, anchor: bool
) -> str | None:
    """The run half (`LineageError`): the run id the engine is on once it applies the update. No lineage
    (older manifests): the version checks decide and the engine leaves any run (`None`). An anchor (no
    range) must overwrite every tensor (`anchor`). Else the engine must be on `run_id` at a version in the
    range or at `version` (a replay); one on no run at version 0 holds version 0 of every run."""
    if lineage is None:
        return None
    if lineage.min_version is None:
        if not anchor:
            raise LineageError(
                f"run {lineage.run_id!r}: an update valid on any weights must be a full anchor"
            )
        return lineage.run_id
    lo, hi = lineage.min_version, lineage.max_version
    assert lo is not None and hi is not None  # a ranged lineage has both (`Lineage._range`)
    if engine_run_id is None:
        if engine_version != 0 or not lo <= 0 <= hi:
            raise LineageError(
                f"engine is on no run's lineage at version {engine_version}; the update needs run "
                f"{lineage.run_id!r} at versions {lineage.min_version}..{lineage.max_version}"
            )
        return lineage.run_id
    if engine_run_id != lineage.run_id:
        raise LineageError(
            f"engine holds run {engine_run_id!r}'s weights; the update is for run {lineage.run_id!r}"
        )
    if not (lo <= engine_version <= hi or engine_version == version):
        raise LineageError(
            f"engine is at version {engine_version}; the update applies at versions "
            f"{lineage.min_version}..{lineage.max_version} of run {lineage.run_id!r}"
        )
    return lineage.run_id
