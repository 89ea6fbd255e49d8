"""Models: HF causal LMs and tokenizers (incl. GGUF), value-head models, chat templates, the offline catalogue."""

from hybridflow.models.catalogue import (
    MODEL_CATALOGUE,
    CatalogueModel,
    catalogue_gguf_path,
    catalogue_tokenizer_path,
    convert_catalogue_model,
    resolve_model_path,
)
from hybridflow.models.chat_template import CHATML_TEMPLATE
from hybridflow.models.loader import (
    build_causal_lm,
    load_model_and_tokenizer,
    load_tokenizer,
    prepare_tokenizer,
    save_model_and_tokenizer,
    to_torch_dtype,
)
from hybridflow.models.tiny import (
    build_local_tokenizer, build_tiny_model, build_tiny_tokenizer, save_tiny_model, save_tiny_reward_model)
from hybridflow.models.value_head import (
    build_value_model,
    compute_sequence_scores,
    compute_token_level_scores,
)

__all__ = [
    "CHATML_TEMPLATE",
    "MODEL_CATALOGUE",
    "CatalogueModel",
    "build_causal_lm",
    "build_local_tokenizer",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "build_value_model",
    "catalogue_gguf_path",
    "catalogue_tokenizer_path",
    "compute_sequence_scores",
    "compute_token_level_scores",
    "convert_catalogue_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "prepare_tokenizer",
    "resolve_model_path",
    "save_model_and_tokenizer",
    "save_tiny_model",
    "save_tiny_reward_model",
    "to_torch_dtype",
]
