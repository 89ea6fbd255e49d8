"""Registry: the one extension mechanism (STYLE.md)."""

import pytest

from hybridflow.utils.registry import Registry


def test_register_get_and_names():
    registry = Registry("widget")

    @registry.register("a")
    def make_a():
        return "A"

    registry.register("b", len)
    assert registry.get("a") is make_a and registry.get("b") is len
    assert registry.names() == ["a", "b"] and "a" in registry and "z" not in registry


def test_double_registration_and_unknown_names_raise():
    registry = Registry("widget")
    registry.register("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a", 2)
    with pytest.raises(KeyError, match=r"unknown widget 'c'; known: \['a'\]"):
        registry.get("c")


def test_lazy_entries_import_on_first_use_and_reraise_import_errors():
    registry = Registry("backend")
    registry.register_lazy("json_dumps", "json:dumps")
    registry.register_lazy("broken", "hybridflow_no_such_module:thing")
    assert registry.names() == ["broken", "json_dumps"]
    import json

    assert registry.get("json_dumps") is json.dumps
    with pytest.raises(ImportError, match="backend 'broken' needs module 'hybridflow_no_such_module'") as info:
        registry.get("broken")
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(ValueError, match="module:attribute"):
        registry.register_lazy("bad", "no_colon")

