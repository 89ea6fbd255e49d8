"""STYLE.md fails a source file above 1,000 lines; issue 28 holds the package to 600: no file under hybridflow/ may
exceed it."""

from pathlib import Path

MAX_LINES = 600


def test_no_source_file_exceeds_the_line_limit():
    root = Path(__file__).resolve().parents[1] / "hybridflow"
    sizes = {path: len(path.read_text().splitlines()) for path in root.rglob("*.py")}
    assert sizes, "found no source files: is the package where the test expects?"
    too_big = {str(path.relative_to(root)): lines for path, lines in sizes.items() if lines > MAX_LINES}
    assert not too_big, f"split these files by concept (see shared/STYLE.md): {too_big}"
