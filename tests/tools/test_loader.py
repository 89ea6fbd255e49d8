"""Loading tools from verl's tools YAML: by registry name, by class path, and errors that name the entry."""

from __future__ import annotations

import textwrap

import pytest

from hybridflow.tools import load_tools
from hybridflow.tools.calculator import CalculatorTool
from hybridflow.tools.search import SearchTool
from tests.tools.helpers import run

TOOLS_YAML = """
tools:
  - name: calculator
    config: {type: native, max_exponent: 100}
  - class_name: hybridflow.tools.calculator.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: math
        description: Evaluate arithmetic.
        parameters:
          type: object
          properties:
            expression: {type: string, description: The expression.}
          required: [expression]
  - name: search
    config:
      documents: ["Paris is the capital of France.", "Bananas are yellow."]
      top_k: 1
"""


def write(tmp_path, text: str):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_load_by_registry_name_and_class_name(tmp_path):
    tools = load_tools(write(tmp_path, TOOLS_YAML))
    assert list(tools) == ["calculator", "math", "search"]
    assert isinstance(tools["calculator"], CalculatorTool) and tools["calculator"].config.max_exponent == 100
    assert isinstance(tools["math"], CalculatorTool) and tools["math"].name == "math"
    assert tools["math"].get_openai_tool_schema().to_dict()["function"]["description"] == "Evaluate arithmetic."
    assert isinstance(tools["search"], SearchTool)

    async def use():
        instance_id = await tools["math"].create()
        return await tools["math"].execute(instance_id, {"expression": "6 * 7"})

    assert run(use())[0].text == "42"


def test_load_from_a_list_and_from_omegaconf():
    from omegaconf import OmegaConf

    entries = [{"name": "calculator"}]
    assert list(load_tools(entries)) == ["calculator"]
    assert list(load_tools(OmegaConf.create({"tools": entries}))) == ["calculator"]


@pytest.mark.parametrize(("entries", "message"), [
    ("- {config: {}}", "tools[0] needs exactly one of 'class_name' (a dotted class path) or 'name'"),
    ("- {name: calculator}\n- {name: abacus}", "tools[1].name: unknown tool 'abacus'; known: ["),
    ("- {class_name: hybridflow.tools.nope.Tool}",
     "tools[0].class_name='hybridflow.tools.nope.Tool': cannot import"),
    ("- {class_name: verl.tools.geo3k_tool.Geo3kTool}",  # a verl tools YAML
     "of verl's tool classes hybridflow builds only ['verl.tools.gsm8k_tool.Gsm8kTool', "
     "'verl.tools.sandbox_fusion_tools.SandboxFusionTool']: name a registered tool instead (`name: <tool>`, one of ["),
    ("- {class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool, config: {}}",
     "tools[0].config: tool 'code_interpreter': invalid config {}: config.sandbox_fusion_url is not set"),
    ("- {class_name: hybridflow.tools.calculator.Nope}",
     "module 'hybridflow.tools.calculator' has no attribute 'Nope'"),
    ("- {class_name: hybridflow.tools.schemas.ToolResponse}",
     "tools[0].class_name='hybridflow.tools.schemas.ToolResponse' is not a BaseTool"),
    ("- {class_name: hybridflow.tools.base.BaseTool}",
     "tools[0].tool_schema is required: BaseTool has no default schema"),
    ("- {name: calculator, schema: {}}", "tools[0] has unknown keys ['schema']"),
    ("- {name: calculator, config: [1]}", "tools[0].config must be a mapping"),
    ("- {name: calculator, config: {precision: 3}}",
     "tools[0].config: tool 'calculator': unknown config keys ['precision']"),
    ("- {name: calculator, tool_schema: {type: function, function: {description: x}}}",
     "tools[0].tool_schema.function is missing keys ['name']"),
    ("- {name: calculator}\n- {name: calculator}", "tools[1]: a tool named 'calculator' is already defined"),
])
def test_bad_entries_name_the_index_and_field(tmp_path, entries, message):
    path = write(tmp_path, "tools:\n" + textwrap.indent(entries, "  "))
    with pytest.raises(ValueError) as info:
        load_tools(path)
    assert f"{path}: " in str(info.value) and message in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        load_tools(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="must be a list of tool entries"):
        load_tools(write(tmp_path, "tool: []"))
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_tools(write(tmp_path, "tools: [a, {b: \n"))
