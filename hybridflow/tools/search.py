"""The `search` tool: BM25 retrieval (the `bm25s` package) over a small local corpus, top-k passages as text.

The corpus is a JSONL file (`corpus_path`, one JSON object per line) or an inline `documents` list (strings
or objects) given in the tool's config; it is indexed once when the tool is built. Nothing touches the
network.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bm25s

from hybridflow.tools.base import BaseTool, ToolInstance, build_tool_config
from hybridflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["Passage", "SearchConfig", "SearchTool", "load_passages"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """The corpus and output limits of the search tool (the YAML entry's `config:`)."""

    corpus_path: str | None = None
    """A JSONL file, one document object per line. Give this or `documents`, not both."""

    documents: list[Any] | None = None
    """Inline documents: strings, or objects like those in a `corpus_path` file."""

    text_field: str = "text"
    """The key holding a document object's text (e.g. 'contents' for pyserini-style corpora)."""

    title_field: str = "title"
    """The key holding a document object's title; it is optional in each document."""

    top_k: int = 3
    """Passages returned per query (fewer when fewer documents match any query term)."""

    max_chars_per_passage: int = 1000
    """Each returned passage is cut to this many characters."""

    stopwords: str | None = "en"
    """bm25s stopword list dropped from documents and queries; None keeps every word."""

    def __post_init__(self) -> None:
        if (self.corpus_path is None) == (self.documents is None):
            raise ValueError("search config needs exactly one of corpus_path (a JSONL file) or documents "
                             f"(an inline list); got corpus_path={self.corpus_path!r} and "
                             f"documents={'a list' if self.documents is not None else None}")
        if self.top_k <= 0:
            raise ValueError(f"search config.top_k must be > 0, got {self.top_k}")
        if self.max_chars_per_passage <= 0:
            raise ValueError(f"search config.max_chars_per_passage must be > 0, got {self.max_chars_per_passage}")


@dataclass(frozen=True, kw_only=True)
class Passage:
    """One indexed document."""

    text: str
    """The document's text (what BM25 indexes together with the title)."""

    title: str | None = None
    """An optional title, shown before the text."""


def _to_passage(doc: Any, where: str, config: SearchConfig) -> Passage:
    if isinstance(doc, str):
        return Passage(text=doc)
    if not isinstance(doc, dict) or not isinstance(doc.get(config.text_field), str):
        raise ValueError(f"{where} must be a string or an object with a string {config.text_field!r} field "
                         f"(config.text_field), got {str(doc)[:200]!r}")
    title = doc.get(config.title_field)
    return Passage(text=doc[config.text_field], title=str(title) if title is not None else None)


def load_passages(config: SearchConfig) -> list[Passage]:
    """Read the corpus named by `config`; a ValueError names the bad line or list index."""
    if config.documents is not None:
        docs = [(f"search config.documents[{i}]", doc) for i, doc in enumerate(config.documents)]
    else:
        path = Path(config.corpus_path or "")
        if not path.is_file():
            raise ValueError(f"search config.corpus_path={config.corpus_path!r} is not a file; give a JSONL corpus")
        docs = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                docs.append((f"{path}:{line_no}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({err}); write one object per line") from err
    passages = [_to_passage(doc, where, config) for where, doc in docs]
    if not passages:
        raise ValueError(f"search corpus {config.corpus_path or 'documents'} is empty; give at least one document")
    return passages


class SearchTool(BaseTool):
    """Returns the top-k BM25 passages for a query, numbered, as one text block."""

    def __init__(self, config: dict[str, Any] | None = None,
                 tool_schema: OpenAIFunctionToolSchema | dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.config: SearchConfig = build_tool_config(SearchConfig, config, self.name)
        try:
            self.passages = load_passages(self.config)
        except ValueError as err:
            raise ValueError(f"tool {self.name!r}: {err}") from err
        self._retriever = bm25s.BM25()
        self._retriever.index(self._tokenize([self._indexed_text(p) for p in self.passages]), show_progress=False)
        logger.info("search tool %r indexed %d passages", self.name, len(self.passages))

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """`search(query: string)`."""
        return OpenAIFunctionToolSchema.with_string_argument(
            "search", "Search a local document collection by keywords; returns the best matching passages.",
            "query", "Keywords to search for.",
        )

    def search(self, query: str) -> list[tuple[Passage, float]]:
        """The best passages for `query` with their BM25 scores, best first; passages scoring 0 are dropped."""
        k = min(self.config.top_k, len(self.passages))
        indices, scores = self._retriever.retrieve(self._tokenize([query]), k=k, show_progress=False)
        return [(self.passages[int(i)], float(s)) for i, s in zip(indices[0], scores[0], strict=True) if s > 0]

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Search for `parameters["query"]`."""
        hits = self.search(parameters["query"])
        if not hits:
            text = f"No results for {parameters['query']!r}; try other keywords."
        else:
            text = "\n\n".join(self._format(rank, passage) for rank, (passage, _) in enumerate(hits, start=1))
        return ToolResponse(text=text), 0.0, {"num_results": len(hits)}

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        # Plain token lists (not bm25s ids), so queries map onto the corpus vocabulary by word.
        return bm25s.tokenize(texts, stopwords=self.config.stopwords, return_ids=False, show_progress=False)

    @staticmethod
    def _indexed_text(passage: Passage) -> str:
        return f"{passage.title}\n{passage.text}" if passage.title else passage.text

    def _format(self, rank: int, passage: Passage) -> str:
        text = passage.text
        if len(text) > self.config.max_chars_per_passage:
            text = text[: self.config.max_chars_per_passage] + "..."
        title = f" {passage.title}:" if passage.title else ""
        return f"[{rank}]{title} {text}"
