"""The EYRIE_* configuration table of docs/deploy.md and README.md, generated from services/settings.py.

    python docker/config_table.py            # print the table
    python docker/config_table.py --write    # rewrite it between the markers, in docs/deploy.md and README.md
    python docker/config_table.py --check    # exit 1 if any of those tables is stale

A test runs the check, so the table cannot drift from the settings. A field's meaning is its
``Field(description=...)`` (the same text the command-line flags show), else the comment at the end of its line
in services/settings.py; a field with neither fails the check.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploy.md"
README = ROOT / "README.md"
DOCS = (DOC, README)  # both must hold the table between the markers
START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"

def settings_classes() -> dict:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from services.settings import SETTINGS

    return SETTINGS


def source_comments() -> dict[str, str]:
    """Field name -> the comment ending its line in services/settings.py (the first one seen)."""
    source = (ROOT / "services" / "settings.py").read_text()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.lineno in comments:
            out.setdefault(node.target.id, comments[node.lineno])
    return out


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def rows() -> list[tuple[str, str, str, str]]:
    """(variable, services, default, meaning) per field, in the settings' own order; a field whose default
    differs between services lists each."""
    seen: dict[str, dict] = {}
    for role, cls in settings_classes().items():
        for name, field in cls.model_fields.items():
            entry = seen.setdefault(name, {"roles": [], "defaults": {}, "description": field.description})
            entry["roles"].append(role)
            entry["defaults"][role] = _default(field)
    out = []
    comments = source_comments()
    for name, entry in seen.items():
        meaning = entry["description"] or comments.get(name)
        if not meaning:
            raise KeyError(f"settings field {name!r} has no description: give it Field(description=...) in "
                           f"services/settings.py")
        defaults = set(entry["defaults"].values())
        default = defaults.pop() if len(defaults) == 1 else ", ".join(
            f"{role}: {d}" for role, d in entry["defaults"].items())
        roles = "all" if len(entry["roles"]) == 3 else ", ".join(entry["roles"])
        out.append((f"`EYRIE_{name.upper()}`", roles, default, meaning))
    return out


def table() -> str:
    lines = ["| variable | services | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| {v} | {s} | {d} | {m} |" for v, s, d, m in rows()]
    return "\n".join(lines)


def current_table(doc: str, name: str = "the document") -> str:
    if START not in doc or END not in doc:
        raise ValueError(f"{name} lacks the markers {START} ... {END}")
    return doc.split(START, 1)[1].split(END, 1)[0].strip()


def documents() -> list[Path]:
    return list(DOCS)


def write() -> None:
    for path in documents():
        doc = path.read_text()
        head, rest = doc.split(START, 1)
        path.write_text(f"{head}{START}\n{table()}\n{END}{rest.split(END, 1)[1]}")


def main(argv: list[str]) -> int:
    if "--write" in argv:
        write()
    elif "--check" in argv:
        stale = [p for p in documents() if current_table(p.read_text(), p.name) != table()]
        for path in stale:
            print(f"{path} has a stale configuration table: run python docker/config_table.py --write",
                  file=sys.stderr)
        return 1 if stale else 0
    else:
        print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
