"""scripts/fetch_models.py's disk check: a full disk fails before any download, with its numbers."""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fetch_models  # noqa: E402


def test_bytes_needed_covers_the_bf16_weights_and_the_largest_download():
    both = [fetch_models.TARGET, fetch_models.DRAFT]
    need = fetch_models.bytes_needed(both)
    # What the converted models measured on disk (3.4 GB + 1.2 GB) plus the 1.5B GGUF.
    assert need > 3.4e9 + 1.2e9 + fetch_models.TARGET.size
    assert need < 8e9
    assert fetch_models.bytes_needed([]) == 0


def test_a_short_disk_fails_naming_need_and_free(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fetch_models.shutil, "disk_usage",
                        lambda path: usage._replace(free=int(2e9)))
    missing_dir = tmp_path / "not" / "yet"
    with pytest.raises(fetch_models.FetchError, match=r"need about 6\.\d GB free .* has 2\.0 GB free"):
        fetch_models.check_free_space([fetch_models.TARGET, fetch_models.DRAFT], missing_dir,
                                      tmp_path / "wheels")
    # Models already converted need nothing.
    fetch_models.check_free_space([], missing_dir, tmp_path / "wheels")
