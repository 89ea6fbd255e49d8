"""Every name the package uses is defined: pyflakes reads each module without importing it, so a name removed in
one place and still used in another (which fails only on the path that reaches it, e.g. in a Ray worker saving a
checkpoint) is caught in a second."""

from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages, reporter

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"

ERRORS = (messages.UndefinedName, messages.UndefinedExport, messages.UndefinedLocal)


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def unexpectedError(self, filename, msg) -> None:  # noqa: N802 - pyflakes' interface
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802
        self.found.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message) -> None:
        if isinstance(message, ERRORS):
            self.found.append(str(message))


def test_the_package_uses_no_undefined_name():
    collected = _Collect()
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100
    for path in files:
        api.checkPath(str(path), collected)
    assert collected.found == []


def test_the_check_sees_an_undefined_name(tmp_path):
    module = tmp_path / "broken.py"
    module.write_text("def save(engine):\n    return {'layout': _layout(engine)}\n")
    collected = _Collect()
    api.checkPath(str(module), collected)
    assert len(collected.found) == 1 and "undefined name '_layout'" in collected.found[0]
