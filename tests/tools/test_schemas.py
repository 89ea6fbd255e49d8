"""OpenAI tool schemas: round trip, field errors, argument validation, and use in a chat template."""

from __future__ import annotations

import pytest

from hybridflow.tools import OpenAIFunctionToolSchema, validate_arguments

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "default": 1},
                "threshold": {"type": "number"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city"],
        },
    },
}


def test_round_trip_keeps_the_openai_dict():
    schema = OpenAIFunctionToolSchema.from_dict(WEATHER)
    assert schema.name == "get_weather"
    assert schema.function.parameters.properties["unit"].enum == ["celsius", "fahrenheit"]
    assert schema.to_dict() == WEATHER
    assert OpenAIFunctionToolSchema.from_dict(schema.to_dict()) == schema


def test_constructor_accepts_plain_dicts():
    from hybridflow.tools import OpenAIFunctionParametersSchema, OpenAIFunctionSchema

    schema = OpenAIFunctionToolSchema(function=OpenAIFunctionSchema(
        name="get_weather", description="Current weather in a city.",
        parameters=OpenAIFunctionParametersSchema(properties=WEATHER["function"]["parameters"]["properties"],
                                                  required=["city"])))
    assert schema.to_dict() == WEATHER
    assert OpenAIFunctionToolSchema(function=WEATHER["function"]) == schema


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.pop("function"), "tool_schema is missing keys ['function']"),
    (lambda d: d.update(kind="x"), "tool_schema has unknown keys ['kind']"),
    (lambda d: d.update(type="retrieval"), "tool schema type must be 'function'"),
    (lambda d: d["function"].pop("name"), "tool_schema.function is missing keys ['name']"),
    (lambda d: d["function"]["parameters"]["properties"]["city"].update(descripton="x"),
     "tool_schema.function.parameters.properties.city has unknown keys ['descripton']"),
    (lambda d: d["function"]["parameters"]["properties"]["days"].update(type="int"),
     "tool_schema.function.parameters.properties.days: property type must be one of"),
    (lambda d: d["function"]["parameters"].update(required=["city", "country"]),
     "['country'], which are not in parameters.properties"),
])
def test_from_dict_errors_name_the_field(mutate, message):
    import copy

    data = copy.deepcopy(WEATHER)
    mutate(data)
    with pytest.raises(ValueError) as info:
        OpenAIFunctionToolSchema.from_dict(data)
    assert message in str(info.value)


def test_validate_arguments_messages():
    params = OpenAIFunctionToolSchema.from_dict(WEATHER).function.parameters
    assert validate_arguments(params, {"city": "Paris", "unit": "celsius", "days": 3, "threshold": 2,
                                       "tags": ["a"], "note": None}) == []
    assert validate_arguments(params, {"city": "Paris", "days": 3.0}) == []  # 3.0 is a JSON integer
    assert validate_arguments(params, {}) == ["missing required argument 'city'"]
    assert validate_arguments(params, {"city": "Paris", "zip": 1}) == [
        "unknown argument 'zip'; known arguments: ['city', 'days', 'note', 'tags', 'threshold', 'unit']"]
    assert validate_arguments(params, {"city": 5, "days": True, "note": 1}) == [
        "argument 'city' must be of type string, got integer",
        "argument 'days' must be of type integer, got boolean",
        "argument 'note' must be of type string or null, got integer",
    ]
    assert validate_arguments(params, {"city": "Paris", "unit": "kelvin"}) == [
        "argument 'unit' must be one of ['celsius', 'fahrenheit'], got 'kelvin'"]
    assert validate_arguments(params, ["Paris"]) == ["arguments must be a JSON object, got array"]


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
)


def test_schema_dict_goes_into_chat_templates():
    """SmolLM2's template (the tiny test tokenizer) ignores tools; a Qwen-style one renders them as JSON."""
    from hybridflow.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    schema = OpenAIFunctionToolSchema.from_dict(WEATHER)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = tokenizer.apply_chat_template(messages, tools=[schema.to_dict()], tokenize=False)
    assert "Weather in Paris?" in text
    rendered = tokenizer.apply_chat_template(messages, tools=[schema.to_dict()], tokenize=False,
                                             chat_template=TOOLS_TEMPLATE)
    assert '"name": "get_weather"' in rendered and '"enum": ["celsius", "fahrenheit"]' in rendered
