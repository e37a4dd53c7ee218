"""The demo's text corpus (the Python standard library's source as byte tokens), from the
package: :mod:`mtp_ctrl.cli.byte_corpus`. Re-exported here for the example scripts."""

from mtp_ctrl.cli.byte_corpus import (  # noqa: F401
    BYTE_VOCAB_SIZE,
    ByteCorpus,
    decode_bytes,
    evenly_spaced_windows,
    load_stdlib_corpus,
    sample_windows,
    stdlib_source_files,
)
