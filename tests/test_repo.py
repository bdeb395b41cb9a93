"""The repository itself: one copy of each helper, scripts that use the package's constants, folders that show the
layers."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from batchspec_cli.errors import one_line
from batchspec_cli.models import loading as models

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("batchspec_cli/**/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("benchmarks/*.py")])


def test_one_line_is_defined_once_and_used_everywhere():
    defining = [p.relative_to(ROOT).as_posix() for p in SOURCES
                if re.search(r"^def _?one_line\(", p.read_text(), re.M)]
    assert defining == ["batchspec_cli/errors.py"]
    inline = [p.name for p in SOURCES if '" ".join(str(exc).split())' in p.read_text() or
              "' '.join(str(exc).split())" in p.read_text()]
    assert inline == ["errors.py"]
    assert one_line(ValueError("a\n  b\tc")) == "a b c" and one_line(KeyError()) == "KeyError"
    assert len(one_line(ValueError("x" * 1000))) == 300


def test_scripts_use_the_package_s_cache_keyword_and_default_gguf():
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_draft

    assert train_draft.cache_kwarg is models.cache_kwarg
    for path in ROOT.glob("scripts/*.py"):
        text = path.read_text()
        assert models.DEFAULT_GGUF not in text and "def cache_kw" not in text, path.name


def test_torch_is_a_range_and_pinned_only_in_the_install_commands():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    assert {s.operator for s in torch_req.specifier} == {">="}  # no cap: pip never downgrades a newer torch
    assert torch_req.specifier.contains("2.13.0") and torch_req.specifier.contains("2.20.0")
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")][:2]
    ci = (ROOT / ".ci" / "run").read_text()
    for text in [command.replace(" -q", "") for command in [*commands, ci]]:  # the CPU wheel, then the package
        assert 0 <= text.index("pip install torch==2.13.0") < text.index("pip install -e")
    assert len(commands) == 2 and "pip install -e ." in commands[0] and "pip install -e '.[test" in commands[1]


def readme_section(title: str, doc: str = "README.md") -> str:
    text = (ROOT / doc).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return " ".join(text[start: end if end != -1 else len(text)].split())


def test_readme_promises_only_what_holds():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "so sampled rows match too" not in readme  # only in float64 do they match bit for bit
    guaranteed = readme_section("What is guaranteed")
    for claim in ("The distribution is exact", "identical up to float near-ties", "float64", "float32 and bfloat16",
                  "Greedy and sampled rows alike", "`batchspec verify`", "near-tie", "unexplained"):
        assert claim in guaranteed, claim
    size = readme_section("Repository size", "docs/operations.md")  # the policy for maintainers, out of the README
    assert "at least 3 points of held-out acceptance" in size and "replaces" in size and "not rewritten" in size


LAYERS = ["policy", "models", "engine", "store", "io", "job"]  # batchspec_cli's folders, from the ground up
FOUNDATION = {"errors", "config", "__version__"}  # batchspec_cli/errors.py, config.py, __init__.py: under every layer


def imported(path: Path) -> list[str]:
    """The package's own names that a module imports, as dotted paths below ``batchspec_cli`` (``engine.events``)."""
    package = path.relative_to(ROOT).parent.parts  # ("batchspec_cli", "io")
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = [*package[1:len(package) - node.level + 1], *([node.module] if node.module else [])]
            names += [".".join(base)] if node.module else [".".join([*base, a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchspec_cli."):
            names.append(node.module.removeprefix("batchspec_cli."))
    return names


def test_each_layer_imports_only_the_layers_below_it():
    """input and storage above the engine, the engine above models and policy, the job on top; the command line,
    `verify`, `stats` and the Ray runner beside ``cli.py`` may import any of them, no layer imports those."""
    for path in sorted(ROOT.glob("batchspec_cli/*/*.py")):
        below = LAYERS[:LAYERS.index(path.parent.name) + 1]
        for name in imported(path):
            assert name.split(".")[0] in [*below, *FOUNDATION], f"{path.relative_to(ROOT)} imports {name}"
    drafters = set(imported(ROOT / "batchspec_cli" / "engine" / "drafters.py"))  # the reading itself, on one module
    assert {"models.attention", "policy", "engine.sampling", "engine.align"} <= drafters


def test_only_the_tool_s_own_name_is_installed():
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(ROOT, include=find["include"])
    assert {p.split(".")[0] for p in packages} == {"batchspec_cli"}  # no top-level `buckets` beside it
    assert {f"batchspec_cli.{layer}" for layer in LAYERS} <= set(packages)
