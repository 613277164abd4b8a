"""`tessera-dev crd-reference`: docs/crd-reference.md, rendered from the openAPIV3Schema of every
CRD tessera_contracts ships: one table per object, each field's type, whether it is required, its
default, its bounds and rules, whether it is immutable, and its description."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from tessera_contracts import api
from tessera_dev import paths

DOC = "docs/crd-reference.md"
Schema = dict[str, Any]

# schema keyword -> how its bound reads
BOUNDS = (("minimum", ">= {}"), ("maximum", "<= {}"), ("minLength", "length >= {}"),
          ("maxLength", "length <= {}"), ("minItems", "items >= {}"), ("maxItems", "items <= {}"),
          ("maxProperties", "keys <= {}"), ("pattern", "pattern `{}`"), ("format", "format {}"))


@dataclass
class Row:
    name: str
    schema: Schema
    required: bool
    # the rules that name this field (their fieldPath) or sit on it, immutability among them
    rules: list[Schema] = field(default_factory=list)


@dataclass
class Section:
    """One object of the schema: its path and its fields, in the schema's order."""
    path: str
    schema: Schema
    rows: list[Row] = field(default_factory=list)
    # its own rules that name no field
    rules: list[Schema] = field(default_factory=list)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def literal(value: Any) -> str:
    return f"`{json.dumps(value, separators=(', ', ': '))}`"


def type_of(schema: Schema) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int-or-string"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"[]{type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map[string]{type_of(schema['additionalProperties'])}"
    if kind == "object" and schema.get("x-kubernetes-preserve-unknown-fields"):
        return "object (open)"
    return kind


def immutable(rule: Schema) -> bool:
    return "oldSelf" in rule["rule"]


def bounds(schema: Schema, prefix: str = "") -> list[str]:
    notes = [prefix + "one of " + ", ".join(f"`{value}`" for value in schema["enum"])
             ] if "enum" in schema else []
    return notes + [prefix + text.format(schema[key]) for key, text in BOUNDS if key in schema]


def constraints(row: Row) -> str:
    """The field's bounds, enum, list keys and rules, immutability first."""
    notes = ["**immutable**"] if any(immutable(rule) for rule in row.rules) else []
    notes += bounds(row.schema)
    if isinstance(row.schema.get("items"), dict):
        notes += bounds(row.schema["items"], "each item ")
    if isinstance(row.schema.get("additionalProperties"), dict):
        notes += bounds(row.schema["additionalProperties"], "each value ")
    if row.schema.get("x-kubernetes-list-type") == "map":
        keys = ", ".join(row.schema["x-kubernetes-list-map-keys"])
        notes.append(f"one item per {keys}")
    if row.schema.get("x-kubernetes-list-type") == "set":
        notes.append("items unique")
    notes += [rule["message"] for rule in row.rules if not immutable(rule)]
    return "; ".join(cell(note) for note in notes)


def walk(schema: Schema, path: str, sections: list[Section], rows: dict[str, Row],
         ruled: list[tuple[str, Schema]]) -> None:
    """`sections` gets the object at `path` and, after it, every object below it; `rows` each
    field by its path; `ruled` each schema node that carries rules, by its path."""
    section = Section(path, schema)
    sections.append(section)
    required = set(schema.get("required", []))
    for name, child in schema.get("properties", {}).items():
        below = f"{path}.{name}" if path else name
        row = rows[below] = Row(name, child, name in required)
        section.rows.append(row)
        if child.get("x-kubernetes-validations") and not child.get("properties"):
            ruled.append((below, child))
        while child.get("type") == "array" and "items" in child:
            child, below = child["items"], f"{below}[]"
        if child.get("properties"):
            walk(child, below, sections, rows, ruled)
    if schema.get("x-kubernetes-validations"):
        ruled.append((path, schema))


def place_rules(sections: list[Section], rows: dict[str, Row],
                ruled: list[tuple[str, Schema]]) -> None:
    """Each rule goes to the field its fieldPath names, else to the object or field it is on."""
    by_path = {section.path: section for section in sections}
    for path, schema in ruled:
        for rule in schema["x-kubernetes-validations"]:
            named = path + rule["fieldPath"] if "fieldPath" in rule else None
            if named is not None and named.lstrip(".") in rows:
                rows[named.lstrip(".")].rules.append(rule)
            elif path in by_path:
                by_path[path].rules.append(rule)
            else:
                rows[path].rules.append(rule)


def render_rules(rules: list[Schema], lines: list[str]) -> None:
    lines += [f"- {cell(rule['message'])}" for rule in rules]


def render_crd(crd: Schema, lines: list[str]) -> None:
    spec = crd["spec"]
    names = spec["names"]
    for version in spec["versions"]:
        lines += ["", f"## {names['kind']}", ""]
        short = ", ".join(f"`{name}`" for name in names.get("shortNames", []))
        lines.append(f"`apiVersion: {spec['group']}/{version['name']}`, {spec['scope'].lower()}; "
                     f"`kubectl get {names['plural']}`" + (f" (short: {short})" if short else "")
                     + ".")
        sections: list[Section] = []
        rows: dict[str, Row] = {}
        ruled: list[tuple[str, Schema]] = []
        walk(version["schema"]["openAPIV3Schema"], "", sections, rows, ruled)
        place_rules(sections, rows, ruled)
        root, *objects = sections
        if root.rules:
            lines += ["", "Rules on the object as a whole:", ""]
            render_rules(root.rules, lines)
        for section in objects:
            if section.path == "metadata":
                continue
            lines += ["", f"### `{section.path}`", ""]
            if "description" in section.schema:
                lines += [cell(section.schema["description"]), ""]
            lines += ["| Field | Type | Required | Default | Validation | Description |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| `{row.name}` | {type_of(row.schema)} | "
                      f"{'yes' if row.required else ''} | "
                      f"{literal(row.schema['default']) if 'default' in row.schema else ''} | "
                      f"{constraints(row)} | {cell(row.schema.get('description', ''))} |"
                      for row in section.rows]
            if section.rules:
                lines += ["", "Rules on the object as a whole:", ""]
                render_rules(section.rules, lines)


def render() -> str:
    lines = ["# CRD reference", "",
             "<!-- Generated from crds by `tessera-dev crd-reference`; "
             "do not edit. -->", "",
             "Every field of Tessera's custom resources, as the API server validates them: one "
             "table per object. Immutable fields are refused once set (a rule on `oldSelf`); a "
             "default is filled in by the API server when the field is absent."]
    for crd in api.crd_documents():
        render_crd(crd, lines)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-dev crd-reference",
                                     description=f"Write {DOC} from the CRDs' schemas.")
    parser.parse_args(argv)
    target = paths.repo_root() / DOC
    target.write_text(render())
    print(f"{DOC}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
