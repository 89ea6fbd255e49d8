"""Building tools from verl's tools YAML format.

    tools:
      - class_name: hybridflow.tools.calculator.CalculatorTool   # or  name: calculator  (the TOOLS registry)
        config: {type: native}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}

`tool_schema` may be left out for tools with a default schema (all built-ins). A bad entry is a ValueError
naming the entry (`tools[1]`) and the field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from hybridflow.tools.base import TOOLS, BaseTool
from hybridflow.tools.schemas import OpenAIFunctionToolSchema
from hybridflow.utils.config import check_mapping_keys
from hybridflow.utils.file_module import import_dotted

__all__ = ["build_tool", "load_tools"]

_ENTRY_KEYS = {"class_name", "name", "config", "tool_schema"}


def _to_plain(data: Any) -> Any:
    """OmegaConf containers (a Hydra config's tools block) as plain dicts and lists; anything else as is."""
    if isinstance(data, DictConfig | ListConfig):
        return OmegaConf.to_container(data, resolve=True)
    return data


VERL_TOOL_CLASSES = {"verl.tools.gsm8k_tool.Gsm8kTool": "gsm8k_answer",
                     "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "sandbox_fusion"}
"""verl's tool classes that a registered tool here reproduces (same schema, replies and rewards): a verl tools file
naming one builds this tool, so verl's example configs load unchanged."""


def _resolve_class(entry: Mapping[str, Any], where: str) -> type[BaseTool]:
    if ("class_name" in entry) == ("name" in entry):
        raise ValueError(f"{where} needs exactly one of 'class_name' (a dotted class path) or 'name' "
                         f"(a registered tool: {TOOLS.names()}), got keys {sorted(entry)}")
    if "name" in entry:
        try:
            cls = TOOLS.get(entry["name"])
        except KeyError as err:
            raise ValueError(f"{where}.name: {err.args[0]}") from err
        except ImportError as err:
            raise ValueError(f"{where}.name={entry['name']!r}: {err}") from err
    else:
        if not isinstance(entry["class_name"], str):
            raise ValueError(f"{where}.class_name must be a string, got {entry['class_name']!r}")
        if entry["class_name"] in VERL_TOOL_CLASSES:
            return TOOLS.get(VERL_TOOL_CLASSES[entry["class_name"]])
        cls = import_dotted(
            entry["class_name"], where, "package.module.ToolClass",
            verl_hint=f"of verl's tool classes hybridflow builds only {sorted(VERL_TOOL_CLASSES)}: name a registered "
                      f"tool instead (`name: <tool>`, one of {TOOLS.names()}) or give a class of your own "
                      "(hybridflow.tools.BaseTool)",
        )
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        field = "name" if "name" in entry else "class_name"
        raise ValueError(f"{where}.{field}={entry[field]!r} is not a BaseTool subclass")
    return cls


def build_tool(entry: Mapping[str, Any], where: str = "tool") -> BaseTool:
    """Build one tool from a YAML entry (`class_name`/`name`, `config`, `tool_schema`)."""
    entry = _to_plain(entry)
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a mapping with 'name' or 'class_name', got {entry!r}")
    check_mapping_keys(entry, where, _ENTRY_KEYS)
    cls = _resolve_class(entry, where)
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}.config must be a mapping, got {config!r}")
    schema_data = entry.get("tool_schema")
    if schema_data is None:
        if cls.default_tool_schema() is None:
            raise ValueError(f"{where}.tool_schema is required: {cls.__name__} has no default schema")
        schema = None
    else:
        schema = OpenAIFunctionToolSchema.from_dict(schema_data, f"{where}.tool_schema")
    try:
        return cls(dict(config), schema)
    except ValueError as err:
        raise ValueError(f"{where}.config: {err}") from err
    except Exception as err:  # the tool's own constructor failed: name the entry and the class
        raise ValueError(f"{where}: {cls.__name__}(config, tool_schema) raised {type(err).__name__}: {err}") from err


def load_tools(config: str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Mapping[str, Any]
               ) -> dict[str, BaseTool]:
    """Build every tool of a tools config; return tool name (what the model calls) -> tool.

    Args:
        config: a YAML file path, a mapping with a `tools` list (the parsed file), or the list itself.
    """
    source = "tools"
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"tools config {str(path)!r} is not a file; give the path of a tools YAML file")
        source = f"{path}: tools"
        try:
            config = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ValueError(f"tools config {str(path)!r} is not valid YAML: {err}") from err
    config = _to_plain(config)
    entries = config.get("tools") if isinstance(config, Mapping) else config
    if not isinstance(entries, Sequence) or isinstance(entries, str | bytes):
        raise ValueError(f"{source} must be a list of tool entries (a top-level 'tools:' key in YAML), "
                         f"got {type(entries).__name__}")
    tools: dict[str, BaseTool] = {}
    for index, entry in enumerate(entries):
        tool = build_tool(entry, f"{source}[{index}]")
        if tool.name in tools:
            raise ValueError(f"{source}[{index}]: a tool named {tool.name!r} is already defined; "
                             f"give it another tool_schema.function.name")
        tools[tool.name] = tool
    return tools
