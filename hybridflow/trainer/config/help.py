"""`hybridflow train --help [SECTION]`: every key of a config tree with its type, default and doc line."""

from __future__ import annotations

import textwrap
from itertools import groupby

from hybridflow.trainer.config.loader import ConfigTree
from hybridflow.utils.config import FieldHelp, describe_fields


def _section(item: FieldHelp) -> str:
    return item.key.rpartition(".")[0] or "(root)"


def format_help(tree: ConfigTree, section: str | None = None) -> str:
    """The keys of `tree` grouped by section; with `section`, only the keys below it (ValueError if none)."""
    items = list(describe_fields(tree.root, derived=tree.derived))
    if section:
        items = [item for item in items if item.key == section or item.key.startswith(section + ".")]
        if not items:
            sections = sorted({_section(item) for item in describe_fields(tree.root)})
            raise ValueError(f"no config section {section!r}; sections: {', '.join(sections)}")
    aliases = {new: old for old, new in tree.aliases.items()}
    lines = []
    for name, group in groupby(items, key=_section):
        lines.append(f"[{name}]")
        for item in group:
            leaf = item.key.rpartition(".")[2]
            alias = f" (also {aliases[item.key]})" if item.key in aliases else ""
            lines.append(f"  {leaf}: {item.type_name} = {item.default!r}{alias}")
            doc = item.doc + (f" Not supported yet: {item.unsupported}." if item.unsupported else "")
            lines.extend(textwrap.wrap(doc, width=110, initial_indent="      ", subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines)
