"""Dump files: the per-document record of the state around layer L's shared-expert down projection (DESIGN §3.1).
Format and sizes: dumps/README.md."""

from l47.dumps.schema import (
    ALL_ARRAYS, HH_F16, HH_F32, INJ_RAW, INJ_XN_DIV4, OPTIONAL_ARRAYS, PROVENANCES, REQUIRED_ARRAYS, SCHEMA_VERSION,
    Dump, DumpError, DumpMeta, content_hash, doc_hash, dump_nbytes, meta_problems, read_dump, validate_dump, write_dump,
)

__all__ = [
    "ALL_ARRAYS", "HH_F16", "HH_F32", "INJ_RAW", "INJ_XN_DIV4", "OPTIONAL_ARRAYS", "PROVENANCES", "REQUIRED_ARRAYS",
    "SCHEMA_VERSION", "Dump", "DumpError", "DumpMeta", "content_hash", "doc_hash", "dump_nbytes", "meta_problems", "read_dump",
    "validate_dump", "write_dump",
]
