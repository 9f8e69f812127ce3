"""The delta wire format (byte layout: docs/wire-format.md): encodings, flush files, manifest, reader and
writer. Imports neither vLLM nor torch.distributed; trainers and engines both use it."""

from .container import Limits
from .deltas import DeltaBatch, ParamChange, ParamDelta
from .digest import HASH_ALGO, bytes_digest, tensor_digest
from .encodings import DEFAULT_ENCODING, ENCODINGS, Encoding, get_encoding
from .errors import (
    BoundsError,
    CorruptDeltaError,
    DeltaError,
    DtypeMismatchError,
    FormatError,
    IncompatibleDeltaError,
    IncompleteDeltaError,
    IntegrityError,
    LimitError,
    ShapeMismatchError,
    UnknownDtypeError,
    UnknownEncodingError,
    UnknownParamError,
    VersionError,
)
from .lineage import check_lineage, check_versions
from .manifest import (
    MANIFEST_NAME,
    FileEntry,
    Lineage,
    LineageError,
    Manifest,
    ParamEntry,
    load_manifest,
    merge_manifests,
    parse_manifest,
    write_manifest,
)
from .reader import DeltaDecoder, DeltaInfo, iter_delta, open_delta, read_delta
from .writer import DeltaWriter, EncodedFlush, FlushBuilder, encode_flush, file_entry, flush_name
