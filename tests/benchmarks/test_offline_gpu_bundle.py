"""benchmarks/offline_gpu_bundle.py's wheel stripping: dropped folders leave the archive and its RECORD."""

from __future__ import annotations

import zipfile

from benchmarks.offline_gpu_bundle import strip_wheel


def test_stripped_wheel_keeps_the_rest_and_a_consistent_record(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    files = {"pkg/__init__.py": "x = 1\n", "pkg/jars/big.jar": "J" * 1000, "pkg/core/raylet": "bin"}
    record = "".join(f"{name},sha256=abc,{len(body)}\n" for name, body in files.items()) + "pkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, body in files.items():
            archive.writestr(name, body)
        archive.writestr("pkg-1.0.dist-info/RECORD", record)
    strip_wheel(wheel, ("pkg/jars/",))
    with zipfile.ZipFile(wheel) as archive:
        assert sorted(archive.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py", "pkg/core/raylet"]
        assert archive.read("pkg/core/raylet") == b"bin"
        rows = archive.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
    assert [row.split(",")[0] for row in rows] == ["pkg/__init__.py", "pkg/core/raylet", "pkg-1.0.dist-info/RECORD"]
