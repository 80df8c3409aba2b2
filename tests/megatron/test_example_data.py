"""examples/data/make_indexed_dataset.py: the licenses in Megatron's indexed format, one
document per license, byte tokens plus EOD, the same bytes every time they are built."""

import hashlib
import importlib.util
import os

import numpy as np

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron)

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "make_indexed_dataset", os.path.join(ROOT, "examples", "data", "make_indexed_dataset.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

# sha256 of the files built from licenses.txt (uint16 tokens, Megatron 0.19.2's .idx format)
BIN_SHA256 = "7c290256b9439d0ec59d9bbb68e207150ccb1c5e9b56eca70c0ddf60b0a86d56"
IDX_SHA256 = "a0d8ed64aeb5bf023b2946bffbcf58f107ce0c97ce81ab4e2f5921bd6bb30ecb"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_building_twice_gives_identical_bytes(tmp_path):
    first, second = str(tmp_path / "a" / "licenses"), str(tmp_path / "b" / "licenses")
    make.main(["--output-prefix", first])
    make.ensure_built(second)
    for ext, want in ((".bin", BIN_SHA256), (".idx", IDX_SHA256)):
        assert sha256(first + ext) == sha256(second + ext) == want
    assert sorted(os.listdir(tmp_path / "a")) == ["licenses.bin", "licenses.idx"]  # no temporary left


def test_one_document_per_license_as_bytes_then_eod(tmp_path):
    prefix = make.ensure_built(str(tmp_path / "licenses"))
    dataset = IndexedDataset(prefix)
    with open(make.TEXT, "rb") as f:
        text = f.read()
    assert len(dataset) == len(make.DOCUMENT_STARTS) == 13
    assert dataset.document_indices.tolist() == list(range(14))
    ends = (*make.DOCUMENT_STARTS[1:], len(text))
    for i, (start, end) in enumerate(zip(make.DOCUMENT_STARTS, ends)):
        doc = dataset[i]
        assert doc.dtype == np.uint16 and doc[-1] == make.EOD == make.VOCAB_SIZE - 1
        assert bytes(doc[:-1].astype(np.uint8)) == text[start:end]
        assert (doc[:-1] < make.EOD).all()  # EOD only at the end: --reset-attention-mask sees the same documents
    # Where the README's table says each license starts.
    assert bytes(dataset[0][:60].astype(np.uint8)).strip().startswith(b"Apache License")
    assert bytes(dataset[12][:26].astype(np.uint8)) == b"A. HISTORY OF THE SOFTWARE"
