"""The search tool: BM25 over a five-document corpus, from a JSONL file or an inline list."""

from __future__ import annotations

import json

import pytest

from hybridflow.tools.search import SearchTool
from tests.tools.helpers import CORPUS, run


@pytest.fixture
def corpus_path(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(doc) for doc in CORPUS) + "\n")
    return path


@pytest.mark.parametrize(("query", "title"), [
    ("What is the capital of France?", "Paris"),
    ("who created the python programming language", "Python"),
    ("highest mountain", "Mount Everest"),
    ("yellow fruit", "Bananas"),
    ("how do plants use sunlight", "Photosynthesis"),
])
def test_right_document_first(corpus_path, query, title):
    tool = SearchTool({"corpus_path": str(corpus_path), "top_k": 2})
    hits = tool.search(query)
    assert hits[0][0].title == title
    assert len(hits) <= 2 and hits[0][1] > 0


def test_response_text_and_no_results():
    tool = SearchTool({"documents": ["Paris is in France.", "Lyon is in France too.",
                                     {"title": "Berlin", "text": "Berlin is in Germany."}],
                       "max_chars_per_passage": 12})

    async def calls():
        instance_id = await tool.create()
        return [await tool.execute(instance_id, {"query": q}) for q in ("berlin germany", "quantum chromodynamics")]

    (found, _, found_metrics), (empty, _, empty_metrics) = run(calls())
    assert found.text == "[1] Berlin: Berlin is in..."
    assert found_metrics["num_results"] == 1 and found_metrics["error"] is False
    assert empty.text == "No results for 'quantum chromodynamics'; try other keywords."
    assert empty_metrics["num_results"] == 0


def test_text_field_for_pyserini_style_corpora(tmp_path):
    path = tmp_path / "wiki.jsonl"
    path.write_text('{"id": "1", "contents": "Tokyo is the capital of Japan."}\n'
                    '{"id": "2", "contents": "Ottawa is the capital of Canada."}\n')
    tool = SearchTool({"corpus_path": str(path), "text_field": "contents", "top_k": 1})
    assert [passage.text for passage, _ in tool.search("japan")] == ["Tokyo is the capital of Japan."]


@pytest.mark.parametrize(("config", "message"), [
    ({}, "needs exactly one of corpus_path"),
    ({"documents": ["a"], "corpus_path": "x.jsonl"}, "needs exactly one of corpus_path"),
    ({"corpus_path": "/nonexistent/corpus.jsonl"}, "corpus_path='/nonexistent/corpus.jsonl' is not a file"),
    ({"documents": []}, "is empty; give at least one document"),
    ({"documents": ["ok", {"body": "x"}]}, "documents[1] must be a string or an object with a string 'text'"),
    ({"documents": ["ok"], "top_k": 0}, "top_k must be > 0"),
])
def test_config_errors(config, message):
    with pytest.raises(ValueError) as info:
        SearchTool(config)
    assert message in str(info.value)


def test_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        SearchTool({"corpus_path": str(path)})
