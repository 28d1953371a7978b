"""core/paths.written_atomically: the file appears whole under its name, or not at all."""
import os

import pytest

from legacy_engine.core.paths import written_atomically


def test_renamed_when_complete(tmp_path):
    out = tmp_path / "sub" / "f.gguf"            # the folder is made
    with written_atomically(out) as tmp:
        assert os.path.dirname(tmp) == str(out.parent) and not out.exists()
        with open(tmp, "wb") as f:
            f.write(b"whole")
    assert out.read_bytes() == b"whole" and os.listdir(out.parent) == ["f.gguf"]


def test_deleted_when_the_writer_raises(tmp_path):
    out = tmp_path / "f.gguf"
    out.write_bytes(b"old")                        # an earlier file stays as it was
    with pytest.raises(KeyboardInterrupt):
        with written_atomically(out) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"part")
            raise KeyboardInterrupt
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.gguf"]


def test_nothing_written_is_no_error_to_clean(tmp_path):
    with pytest.raises(ValueError):
        with written_atomically(tmp_path / "f.gguf"):
            raise ValueError("before any byte")
    assert os.listdir(tmp_path) == []
