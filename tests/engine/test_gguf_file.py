"""engine/models/gguf_file.py against the `gguf` package's GGUFReader: the same fields and the
same tensors (name, type, ggml shape, numpy dtype, shape and bytes) on the bundled model and
on tiny files of every block type the engine reads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tiny_quant_gguf import write_tiny_gguf

from engine.models.gguf_file import BLOCK_SIZES, GGMLType, GGUFFile
from ipc.model_source import bundled_gguf


def _same_as_gguf_reader(path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    # NOTE: GGUFReader adds the header's counts as GGUF.* fields
    header = {k: ref.fields.pop(k).contents() for k in list(ref.fields) if k.startswith("GGUF.")}
    assert header == {"GGUF.version": ours.version, "GGUF.tensor_count": len(ours.tensors),
                      "GGUF.kv_count": len(ours.fields)}
    assert set(ours.fields) == set(ref.fields)
    for key, field in ref.fields.items():
        assert ours.fields[key] == field.contents(), key
    assert len(ours.tensors) == len(ref.tensors)
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert (t.name, t.tensor_type, t.shape) == (r.name, r.tensor_type, tuple(r.shape))
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data.view(np.uint8), r.data.view(np.uint8)), t.name
        assert not t.data.flags.writeable
    return ours


def test_the_type_table_is_the_gguf_packages():
    """Every ggml type the installed `gguf` package knows, with its name and block size."""
    ours = {int(t): (t.name, BLOCK_SIZES[t]) for t in GGMLType}
    theirs = {int(t): (t.name, gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert ours == theirs


def test_an_unknown_tensor_type_is_named(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("odd.weight", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = bytearray(path.read_bytes())
    # NOTE: the tensor's info: its name, 1 dim (u32), the dim (u64), then the type id (u32);
    # 33 is an id ggml retired (Q4_0_4_4)
    at = raw.index(b"odd.weight") + len(b"odd.weight") + 4 + 8
    assert raw[at:at + 4] == (0).to_bytes(4, "little")  # F32
    raw[at:at + 4] = (33).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="odd.weight has the unknown ggml type 33"):
        GGUFFile(path)


def test_bundled_model_reads_as_gguf_reader_does():
    f = _same_as_gguf_reader(bundled_gguf())
    assert len(f.fields["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize("type_name", ["F16", "Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_tiny_files_read_as_gguf_reader_does(type_name, wide_model_dir, tmp_path):
    _same_as_gguf_reader(write_tiny_gguf(wide_model_dir, tmp_path / "t.gguf", type_name))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(60))
    with pytest.raises(ValueError, match="version 1"):
        GGUFFile(bad)


def test_truncated_and_duplicate_key_files_name_the_file(tmp_path):
    whole = bundled_gguf().read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(whole[:100_000])  # NOTE: inside the tokenizer's arrays
    with pytest.raises(ValueError, match="short.gguf: a truncated or corrupt GGUF"):
        GGUFFile(short)
    short.write_bytes(whole[: len(whole) // 2])  # NOTE: the header whole, tensors cut off
    with pytest.raises(ValueError, match="short.gguf: a truncated or corrupt GGUF"):
        GGUFFile(short)

    def kv(key: bytes, value: int) -> bytes:  # a uint32 field
        return len(key).to_bytes(8, "little") + key + (4).to_bytes(4, "little") + \
            value.to_bytes(4, "little")

    twice = tmp_path / "twice.gguf"
    twice.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
                      + (2).to_bytes(8, "little") + kv(b"a.b", 1) + kv(b"a.b", 2))
    with pytest.raises(ValueError, match="'a.b' appears twice"):
        GGUFFile(twice)


def test_float_tensors_read_as_the_gguf_package_dequantizes_them(tmp_path):
    """The loader's numpy path for F32, F16 and BF16 (no `gguf` import) against
    gguf.quants.dequantize of the same tensors; a block type still goes to the package."""
    from gguf.quants import dequantize, quantize

    from engine.models.loader import _dequantize

    rng = np.random.default_rng(0)
    values = (rng.standard_normal((3, 64)) * 10).astype(np.float32)
    path = tmp_path / "f.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a.weight", values)
    w.add_tensor("b.weight", values.astype(np.float16))
    bf16 = quantize(values, gguf.GGMLQuantizationType.BF16)
    w.add_tensor("c.weight", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
    q8 = quantize(values, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for t in GGUFFile(path).tensors:
        got = _dequantize(t)
        ref = dequantize(np.array(t.data), t.tensor_type)
        assert got.dtype == np.float32 and got.flags.writeable, t.name
        np.testing.assert_array_equal(got, ref.astype(np.float32), err_msg=t.name)
        assert got.shape == (3, 64), t.name
