"""The source tree keeps its shape: small modules, no private names across modules, README's layout is the tree.

These are checks on the code as text (ast), not on behaviour: each one fails on a concrete file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "moebalance"
MAX_LINES = 500


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str | None, level: int, here: Path) -> str:
    """The absolute module a ``from ... import`` names, relative imports resolved against ``here``."""
    if level == 0:
        return module or ""
    package = _module_name(here).split(".")
    if here.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_source_file_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by what they do): {long}"


def test_no_private_name_is_imported_across_modules() -> None:
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = _module_name(path)
        imported_modules: dict[str, str] = {}  # local name -> moebalance module bound by `import` / `from pkg import mod`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(node.module, node.level, path)
                if not source.startswith("moebalance") or source == here:
                    continue
                for alias in node.names:
                    if _is_private(alias.name):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {source}")
                    imported_modules[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("moebalance") and alias.asname:
                        imported_modules[alias.asname] = alias.name
        for node in ast.walk(tree):  # mod._private through a module bound by an import
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr)
                    and node.value.id in imported_modules and (SRC.parent / Path(
                        *imported_modules[node.value.id].split("."))).with_suffix(".py").exists()):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not found, "private names used across modules (make them public or move them):\n" + "\n".join(found)


def _layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1]
    return section.split("```", 2)[1].splitlines()


def test_readme_layout_lists_every_package_and_only_those() -> None:
    lines = _layout_block()
    listed = {m.group(1) for line in lines if (m := re.match(r"^  ([a-z_]+)/\s", line))}
    actual = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert listed == actual, f"README layout lists {sorted(listed)}, the tree has {sorted(actual)}"
    top = {m.group(1) for line in lines if (m := re.match(r"^([a-z_.]+)/\s", line))}
    assert top - {"src"} <= {p.name for p in ROOT.iterdir() if p.is_dir()}, f"README layout names {sorted(top)}"


def test_readme_layout_names_existing_modules() -> None:
    """Each package line reads ``pkg/  mod, mod (note), sub/: what it is``; every module named before the colon
    exists in that package, and every module of the package is named."""
    entries: list[str] = []  # a package's line with its continuation lines (indented past the names)
    for line in _layout_block():
        if re.match(r"^  [a-z_]+/\s", line):
            entries.append(line)
        elif entries and re.match(r"^ {4,}\S", line) and entries[-1].startswith("  "):
            entries[-1] += " " + line.strip()
        else:
            entries.append(line)
    problems = []
    for line in entries:
        m = re.match(r"^  ([a-z_]+)/\s+(.*)$", line)
        if not m:
            continue
        package = SRC / m.group(1)
        if ":" not in m.group(2):
            problems.append(f"{m.group(1)}/ line has no 'modules: description' form")
            continue
        head = re.sub(r"\([^)]*\)", "", m.group(2).split(":", 1)[0])
        named = {w.strip().rstrip("/") for w in head.split(",") if w.strip()}
        for name in sorted(named):
            if not ((package / f"{name}.py").exists() or (package / name).is_dir()):
                problems.append(f"{m.group(1)}/{name} does not exist")
        actual = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
        actual |= {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        for name in sorted(actual - named):
            problems.append(f"{m.group(1)}/{name} is not named in README's layout")
    assert not problems, "README layout and the tree differ: " + "; ".join(problems)
