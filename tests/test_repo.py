"""The repository itself: one copy of each helper, scripts that use the package's constants."""

from __future__ import annotations

import re
import sys
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
    import tomllib

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
