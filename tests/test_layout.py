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


# ----- floors: imports run one way ---------------------------------------------------------------------------------

def _floors() -> dict[str, int]:
    """The floor of every unit, from docs/design.md, "Architecture" (the block that starts ``floor  units``)."""
    section = (ROOT / "docs" / "design.md").read_text().split("## Architecture", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in section.split("```")[1::2] if b.strip().startswith("floor"))
    floors: dict[str, int] = {}
    for line in block.strip().splitlines()[1:]:
        number, *units = line.split()
        for unit in units:
            assert unit not in floors, f"docs/design.md puts {unit} on floors {floors[unit]} and {number}"
            floors[unit] = int(number)
    return floors


def _unit(module: str) -> str:
    """The unit of a ``moebalance`` module: its package, except ``core.errors`` and the top-level modules."""
    if module == "moebalance.core.errors" or module.startswith("moebalance.core.errors."):
        return "core.errors"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moebalance"


def _imported(tree: ast.AST, path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a ``moebalance`` module anywhere in ``tree``: at module level, inside
    functions and under ``TYPE_CHECKING`` alike (``from pkg import mod`` names ``pkg.mod`` where it is a module)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == "moebalance" and \
                ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__"):
            out.append((node.lineno, node.args[0].value))  # importlib.import_module("moebalance.x"), __import__
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "moebalance"]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node.module, node.level, path)
            if source.split(".")[0] != "moebalance":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                is_module = (SRC.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (SRC.parent / Path(*sub.split("."))).is_dir()
                out.append((node.lineno, sub if is_module else source))
    return out


def upward_imports(path: Path, text: str, floors: dict[str, int]) -> list[str]:
    """The imports in ``text`` (the source of ``path``) of a unit on the same floor or above its own, or of a unit
    no floor names."""
    here = _unit(_module_name(path))
    found = []
    for line, module in _imported(ast.parse(text, filename=str(path)), path):
        there = _unit(module)
        if there == here:
            continue
        where = f"{path.relative_to(ROOT)}:{line} ({here}) imports {module} ({there})"
        if here not in floors or there not in floors:
            found.append(f"{where}: a unit docs/design.md's floors do not name")
        elif floors[there] >= floors[here]:
            found.append(f"{where}: floor {floors[there]} is not below floor {floors[here]}")
    return found


def test_every_unit_stands_on_one_floor() -> None:
    """Every package and top-level module of the tree is on docs/design.md's floors, and nothing else is."""
    units = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {"core.errors", "moebalance", *(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")}
    assert set(_floors()) == units, f"floors name {sorted(set(_floors()) - units)}; missing {sorted(units - set(_floors()))}"


def test_every_import_points_down_the_floors() -> None:
    floors = _floors()
    found = [f for path in _sources() for f in upward_imports(path, path.read_text(), floors)]
    assert not found, "imports that do not run down the floors of docs/design.md, \"Architecture\":\n" + \
        "\n".join(found)


def test_the_floor_check_catches_a_planted_upward_import() -> None:
    """The check fails on a lower floor importing a higher one, wherever the import sits."""
    floors = _floors()
    path = SRC / "core" / "load.py"
    text = path.read_text()
    assert upward_imports(path, text, floors) == []
    planted = {
        "module level": text + "\nfrom moebalance.pricing.layer import price_layers\n",
        "inside a function": text + "\n\ndef f() -> None:\n    from moebalance.app import options\n",
        "under TYPE_CHECKING": text + "\nif TYPE_CHECKING:\n    import moebalance.routing.simulate\n",
        "a package of its own floor's neighbours": text + "\nfrom moebalance import cost\n",
        "by name, at run time": text + "\nimportlib.import_module(\"moebalance.pricing\")\n",
    }
    for where, source in planted.items():
        found = upward_imports(path, source, floors)
        assert len(found) == 1 and "is not below floor 2" in found[0], (where, found)
    same_floor = SRC / "cost" / "time.py"
    found = upward_imports(same_floor, same_floor.read_text() + "\nfrom moebalance.algorithms import eplb\n", floors)
    assert len(found) == 1 and "floor 3 is not below floor 3" in found[0]
    package = SRC / "cost" / "__init__.py"  # a package's __init__ and a relative import
    found = upward_imports(package, package.read_text() + "\nfrom ..pricing import price_plan\n", floors)
    assert len(found) == 1 and "imports moebalance.pricing (pricing)" in found[0]


def test_no_command_imports_another_command() -> None:
    commands = SRC / "app" / "commands"
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in commands.glob("*.py") if path.name != "__init__.py"
             for line, module in _imported(ast.parse(path.read_text()), path)
             if module.startswith("moebalance.app.commands")]
    assert not found, "command modules are leaves; share code through app/ or a lower floor:\n" + "\n".join(found)


def test_the_roofline_is_written_in_one_module() -> None:
    """The grouped GEMM's roofline (6 H F FLOPs per pick against 3 H F w bytes per expert) and the GPU's peak rates
    it divides by live in cost/time.py: no other source multiplies them out (code, not docstrings)."""
    pattern = re.compile(r"\b6(\.0)? \* (\w+\.)?(H\b|hidden)|bf16_tflops \*|memory_bandwidth \*")
    found = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and pattern.search(ast.unparse(node)):
                found.add(str(path.relative_to(ROOT)))
    assert found == {"src/moebalance/cost/time.py"}, found


# ----- registries: exactly the documented names --------------------------------------------------------------------

def _documented(section: str) -> list[str]:
    """The names of the first table of docs/design.md's ``section`` (its rows' first cells, backquoted)."""
    text = (ROOT / "docs" / "design.md").read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.MULTILINE)


def test_the_registries_are_the_documented_names() -> None:
    from moebalance.policies import DYNAMIC_POLICIES, POLICIES
    from moebalance.routing import ROUTERS

    assert list(ROUTERS) == _documented("Routers")
    assert [*POLICIES, *DYNAMIC_POLICIES] == _documented("Policies")
