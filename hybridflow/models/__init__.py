"""Models: HF causal LMs and tokenizers (incl. GGUF), value-head models, chat templates, the offline catalogue.
"""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py: the config sections in this
# package import without torch).
_EXPORTS = {
    "MODEL_CATALOGUE": "catalogue",
    "CatalogueModel": "catalogue",
    "catalogue_gguf_path": "catalogue",
    "catalogue_tokenizer_path": "catalogue",
    "convert_catalogue_model": "catalogue",
    "resolve_model_path": "catalogue",
    "CHATML_TEMPLATE": "chat_template",
    "build_causal_lm": "loader",
    "load_model_and_tokenizer": "loader",
    "load_tokenizer": "loader",
    "prepare_tokenizer": "loader",
    "save_model_and_tokenizer": "loader",
    "to_torch_dtype": "loader",
    "build_local_tokenizer": "tiny",
    "build_tiny_model": "tiny",
    "build_tiny_tokenizer": "tiny",
    "save_tiny_model": "tiny",
    "save_tiny_reward_model": "tiny",
    "build_value_model": "value_head",
    "compute_sequence_scores": "value_head",
    "compute_token_level_scores": "value_head",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
