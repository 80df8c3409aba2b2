"""Convert examples/data/licenses.txt into Megatron's indexed dataset format (.bin/.idx).

    python examples/data/make_indexed_dataset.py [--output-prefix PREFIX]

One document per license (the thirteen texts listed in examples/data/README.md, cut at
the byte offsets in :data:`DOCUMENT_STARTS`), byte-level tokens 0..255 followed by one
end-of-document token :data:`EOD` = 256: what Megatron's ``NullTokenizer`` with
``--vocab-size 257`` describes (its EOD id is ``vocab_size - 1``). Written with Megatron's
own ``IndexedDatasetBuilder`` (uint16 tokens), so ``--data-path PREFIX`` reads it like any
dataset made by Megatron's ``tools/preprocess_data.py``.

``examples/pretrain_gpt.py`` calls :func:`ensure_built` when no data flag is given: the
files are built on first use into ``examples/data/build/`` (git-ignored; < 1 s), so the
text stays the one source and no binary sits in the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "licenses.txt")
TEXT_SHA256 = "4e9684c40f010a26ae2e34fccece3690eddc53cc467053d1f7ee1ee8eeaa0667"
DEFAULT_PREFIX = os.path.join(HERE, "build", "licenses_text_document")
# Where each license starts in licenses.txt (the file sizes of the README's cat command).
DOCUMENT_STARTS = (0, 11358, 34313, 41361, 76510, 84162, 102254, 128784, 145510, 171265, 191697, 197808, 199307)
EOD = 256
VOCAB_SIZE = 257  # --vocab-size for NullTokenizer: bytes 0..255 and EOD


def license_documents(path: str = TEXT) -> list[np.ndarray]:
    """The thirteen license texts as byte tokens, each followed by EOD (int64 arrays)."""
    with open(path, "rb") as f:
        text = f.read()
    digest = hashlib.sha256(text).hexdigest()
    if digest != TEXT_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {TEXT_SHA256}: see examples/data/README.md")
    ends = (*DOCUMENT_STARTS[1:], len(text))
    data = np.frombuffer(text, dtype=np.uint8)
    return [np.append(data[s:e].astype(np.int64), EOD) for s, e in zip(DOCUMENT_STARTS, ends)]


def short_documents(num_docs: int = 400, seed: int = 0) -> list[np.ndarray]:
    """Synthetic documents for checks of document masking: lengths 1, 1, 2, 3, 5, then random
    in [1, 120), each a random pattern of 2-6 bytes repeated, then EOD. What a document holds
    predicts its own next tokens, so attention across documents changes the loss, and a
    few-hundred-token sample packs many documents (length 1, shorter than 2*CP, longer than
    a CP chunk)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 1, 2, 3, 5], rng.integers(1, 120, size=num_docs)])
    docs = []
    for n in lengths:
        pattern = rng.integers(0, EOD, size=rng.integers(2, 7))
        docs.append(np.append(np.resize(pattern, n - 1), EOD))
    return docs


def write_indexed_dataset(documents: list[np.ndarray], prefix: str) -> None:
    """``prefix``.bin/.idx with one sequence per document, via Megatron's IndexedDatasetBuilder.

    Written under temporary names and renamed (.bin first, .idx last), so ranks that build
    the same files at the same time never read a half-written one.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: PLC0415

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=np.uint16)
    for doc in documents:
        if doc.min() < 0 or doc.max() > np.iinfo(np.uint16).max:
            raise ValueError("token ids must fit uint16")
        builder.add_document(doc, [len(doc)])
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")


def ensure_built(prefix: str = DEFAULT_PREFIX) -> str:
    """Build the licenses dataset at ``prefix`` unless it is there; returns ``prefix``."""
    if not (os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")):
        write_indexed_dataset(license_documents(), prefix)
    return prefix


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-prefix", default=DEFAULT_PREFIX, help="Writes PREFIX.bin and PREFIX.idx.")
    parser.add_argument("--short-documents", type=int, default=None, metavar="N",
                        help="Write N synthetic short documents (see short_documents) instead of the licenses.")
    args = parser.parse_args(argv)
    docs = license_documents() if args.short_documents is None else short_documents(args.short_documents)
    write_indexed_dataset(docs, args.output_prefix)
    print(f"wrote {args.output_prefix}.bin/.idx: {len(docs)} documents, EOD {EOD}, "
          f"--tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository, for megatron_startrail
    from megatron_startrail.megatron import cpu_patches

    cpu_patches.install_import_shims()  # `import megatron.core` without triton
    main()
