"""OpenAI function-tool schemas, tool responses and parsed function calls, plus argument validation.

`OpenAIFunctionToolSchema.to_dict()` is what goes into `tokenizer.apply_chat_template(..., tools=[...])`;
`from_dict` reads the same shape (verl's `tool_schema:` YAML block). `validate_arguments` checks a model's
call arguments against a parameters schema and returns messages meant for the model, never raising.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.utils.config import check_mapping_keys

__all__ = [
    "EXTRA_PROPERTY_KEYWORDS",
    "FunctionCall",
    "JSON_TYPES",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "validate_arguments",
]

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
"""JSON Schema type names a property may declare."""

EXTRA_PROPERTY_KEYWORDS = (
    "default", "examples", "format", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "minItems", "maxItems", "properties", "required", "additionalProperties",
)
"""JSON Schema keywords a property may carry besides type/description/enum/items (shown to the model only)."""


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if value is not None}


@dataclass(kw_only=True)
class OpenAIFunctionPropertySchema:
    """One parameter of a function: its JSON type, a description for the model and optional choices."""

    type: str | list[str]
    """JSON Schema type name (see `JSON_TYPES`), or a list of them (e.g. `["string", "null"]`)."""

    description: str | None = None
    """What the parameter means, shown to the model."""

    enum: list[Any] | None = None
    """The only values the parameter may take; None allows any value of `type`."""

    items: dict[str, Any] | None = None
    """For `type: array`, the JSON Schema of one element (passed to the model, not validated)."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Other JSON Schema keywords (see `EXTRA_PROPERTY_KEYWORDS`), passed to the model, not validated."""

    def __post_init__(self) -> None:
        types = [self.type] if isinstance(self.type, str) else self.type
        if not isinstance(types, list) or not types or any(t not in JSON_TYPES for t in types):
            raise ValueError(f"property type must be one of {list(JSON_TYPES)} (or a list of them), "
                             f"got {self.type!r}")

    @property
    def types(self) -> list[str]:
        """`type` as a list."""
        return [self.type] if isinstance(self.type, str) else list(self.type)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "property") -> OpenAIFunctionPropertySchema:
        """Build from `{"type": ..., "description": ..., "enum": [...], "items": {...}}`."""
        named = {"type", "description", "enum", "items"}
        check_mapping_keys(data, where, named | set(EXTRA_PROPERTY_KEYWORDS), {"type"})
        try:
            return cls(**{key: value for key, value in data.items() if key in named},
                       extra={key: value for key, value in data.items() if key not in named})
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict, without unset optional keys."""
        return _drop_none({"type": self.type, "description": self.description, "enum": self.enum,
                           "items": self.items, **self.extra})


@dataclass(kw_only=True)
class OpenAIFunctionParametersSchema:
    """The `parameters` object of a function: named properties and which of them are required."""

    type: str = "object"
    """Always 'object' (OpenAI's function-calling format)."""

    properties: dict[str, OpenAIFunctionPropertySchema] = field(default_factory=dict)
    """Parameter name -> its schema (plain dicts are converted)."""

    required: list[str] = field(default_factory=list)
    """Names of the parameters a call must give."""

    def __post_init__(self) -> None:
        self.properties = {  # plain dicts are accepted and converted
            name: OpenAIFunctionPropertySchema.from_dict(prop, f"parameters.properties.{name}")
            if isinstance(prop, Mapping) else prop for name, prop in self.properties.items()}
        if self.type != "object":
            raise ValueError(f"parameters.type must be 'object', got {self.type!r}")
        undeclared = [name for name in self.required if name not in self.properties]
        if undeclared:
            raise ValueError(f"parameters.required names {undeclared}, which are not in parameters.properties; "
                             f"declare them or drop them from required")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "parameters") -> OpenAIFunctionParametersSchema:
        """Build from `{"type": "object", "properties": {...}, "required": [...]}`."""
        check_mapping_keys(data, where, {"type", "properties", "required"}, set())
        properties = data.get("properties") or {}
        if not isinstance(properties, Mapping):
            raise ValueError(f"{where}.properties must be a mapping of name -> schema, got {properties!r}")
        required = data.get("required") or []
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise ValueError(f"{where}.required must be a list of parameter names, got {required!r}")
        parsed = {name: OpenAIFunctionPropertySchema.from_dict(prop, f"{where}.properties.{name}")
                  for name, prop in properties.items()}
        try:
            return cls(type=data.get("type", "object"), properties=parsed, required=list(required))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict."""
        return {"type": self.type, "properties": {name: prop.to_dict() for name, prop in self.properties.items()},
                "required": list(self.required)}


@dataclass(kw_only=True)
class OpenAIFunctionSchema:
    """A function the model may call: its name, what it does and its parameters."""

    name: str
    """The name the model writes in a tool call."""

    description: str = ""
    """What the function does, shown to the model."""

    parameters: OpenAIFunctionParametersSchema = field(default_factory=OpenAIFunctionParametersSchema)
    """The function's parameters (a plain dict is converted)."""

    def __post_init__(self) -> None:
        if isinstance(self.parameters, Mapping):  # a plain dict is accepted and converted
            self.parameters = OpenAIFunctionParametersSchema.from_dict(self.parameters)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"function.name must be a non-empty string, got {self.name!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "function") -> OpenAIFunctionSchema:
        """Build from `{"name": ..., "description": ..., "parameters": {...}}`."""
        check_mapping_keys(data, where, {"name", "description", "parameters", "strict"}, {"name"})
        parameters = OpenAIFunctionParametersSchema.from_dict(data.get("parameters") or {}, f"{where}.parameters")
        try:
            return cls(name=data["name"], description=data.get("description") or "", parameters=parameters)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters.to_dict()}


@dataclass(kw_only=True)
class OpenAIFunctionToolSchema:
    """`{"type": "function", "function": {...}}`: one entry of the `tools` list of a chat template."""

    type: str = "function"
    """Always 'function'."""

    function: OpenAIFunctionSchema
    """The function's schema (a plain dict is converted)."""

    def __post_init__(self) -> None:
        if isinstance(self.function, Mapping):  # a plain dict is accepted and converted
            self.function = OpenAIFunctionSchema.from_dict(self.function)
        if self.type != "function":
            raise ValueError(f"tool schema type must be 'function', got {self.type!r}")

    @property
    def name(self) -> str:
        """The function's name."""
        return self.function.name

    @classmethod
    def with_string_argument(
        cls, name: str, description: str, argument: str, argument_description: str
    ) -> OpenAIFunctionToolSchema:
        """`name(argument: string)`, the argument required: the built-in tools' schema."""
        return cls(function=OpenAIFunctionSchema(
            name=name,
            description=description,
            parameters=OpenAIFunctionParametersSchema(
                properties={argument: OpenAIFunctionPropertySchema(type="string", description=argument_description)},
                required=[argument],
            ),
        ))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "tool_schema") -> OpenAIFunctionToolSchema:
        """Build from the OpenAI dict; a ValueError names the offending key under `where`."""
        check_mapping_keys(data, where, {"type", "function"}, {"function"})
        function = OpenAIFunctionSchema.from_dict(data["function"], f"{where}.function")
        try:
            return cls(type=data.get("type", "function"), function=function)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict for `tokenizer.apply_chat_template(..., tools=[schema.to_dict()])`."""
        return {"type": self.type, "function": self.function.to_dict()}


@dataclass(kw_only=True)
class ToolResponse:
    """What a tool sends back to the model."""

    text: str
    """The tool message's content."""


@dataclass(kw_only=True)
class FunctionCall:
    """A parsed call from the model: the function's name and its decoded JSON arguments."""

    name: str
    """The function the model called."""

    arguments: dict[str, Any] = field(default_factory=dict)
    """Argument name -> JSON value."""


_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}


def _json_type_matches(value: Any, json_type: str) -> bool:
    if isinstance(value, bool) and json_type in ("number", "integer"):
        return False  # bool is an int subclass in Python, but not a JSON number
    if json_type == "integer" and isinstance(value, float):
        return value.is_integer()  # JSON Schema counts 3.0 as an integer
    return isinstance(value, _PYTHON_TYPES[json_type])


def _json_type_name(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _json_type_matches(value, name):
            return name
    return type(value).__name__


def validate_arguments(parameters: OpenAIFunctionParametersSchema, arguments: Any) -> list[str]:
    """Check call arguments against a parameters schema; return one message per problem (empty if valid).

    Checks: `arguments` is an object, required names are present, no unknown names, each value has a
    declared JSON type, and enum membership. The messages are written for the model to read and fix its call.
    """
    if not isinstance(arguments, Mapping):
        return [f"arguments must be a JSON object, got {_json_type_name(arguments)}"]
    errors = [f"missing required argument '{name}'" for name in parameters.required if name not in arguments]
    for name, value in arguments.items():
        prop = parameters.properties.get(name)
        if prop is None:
            known = sorted(parameters.properties) or "none"
            errors.append(f"unknown argument '{name}'; known arguments: {known}")
        elif not any(_json_type_matches(value, json_type) for json_type in prop.types):
            expected = " or ".join(prop.types)
            errors.append(f"argument '{name}' must be of type {expected}, got {_json_type_name(value)}")
        elif prop.enum is not None and value not in prop.enum:
            errors.append(f"argument '{name}' must be one of {prop.enum}, got {value!r}")
    return errors
