"""Shared tool-test helpers: a five-document corpus and running coroutines without an async pytest plugin."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

CORPUS = [
    {"title": "Paris", "text": "Paris is the capital and largest city of France, on the Seine."},
    {"title": "Python", "text": "Python is a programming language created by Guido van Rossum."},
    {"title": "Bananas", "text": "Bananas are long yellow fruit that grow in tropical climates."},
    {"title": "Mount Everest", "text": "Mount Everest is the highest mountain above sea level, in the Himalayas."},
    {"title": "Photosynthesis", "text": "Plants turn sunlight, water and carbon dioxide into sugar by photosynthesis."},
]


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run one coroutine to completion in a fresh event loop."""
    return asyncio.run(coro)
