"""The layers rope_llama/__init__.py declares: every import of every module of the package (type-only and
function-local ones included) reaches only its own package, the top-level module, or a package declared
before its own. Also: no source file outgrows one concern, and the targets older runs' saved configs name
still build."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import rope_llama
from rope_llama.cli.instantiate import build, current_target
from rope_llama.training.callbacks import TextSample

PACKAGE = Path(rope_llama.__file__).resolve().parent


def declared_layers() -> list[str]:
    """The packages of the docstring's list (`    name/   what it holds`), in order."""
    doc = rope_llama.__doc__
    listing = doc[doc.index("Layers") :]
    return re.findall(r"^    (\w+)/ ", listing, flags=re.M)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree` of `module`, anywhere in it: `from rope_llama import data`
    names the package rope_llama.data, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            if base == "rope_llama":  # `from rope_llama import model` imports a package
                found += [(node.lineno, f"rope_llama.{alias.name}") for alias in node.names]
    return sorted(found)


def upward_imports(path: Path, source: str, layers: list[str]) -> list[str]:
    """One line per import of `source` (the module at `path`, relative to the package's parent) that
    reaches a package declared after its own, or any package from the top-level module."""
    parts = path.with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    own = parts[1] if len(parts) > 2 else None  # None: rope_llama/__init__.py itself
    problems = []
    for line, name in imported_modules(ast.parse(source), module, is_package):
        target = name.split(".")
        if target[0] != "rope_llama" or len(target) < 2 or target[1] not in layers or target[1] == own:
            continue
        if own is None or layers.index(target[1]) > layers.index(own):
            where = "the top-level module" if own is None else f"{own}/"
            problems.append(
                f"{path}:{line} imports {name}, but {where} comes before {target[1]}/ in the layers"
            )
    return problems


def test_the_declared_layers_name_every_package_once():
    layers = declared_layers()
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert len(layers) == len(set(layers)) and sorted(layers) == packages


def test_no_module_imports_a_package_declared_after_its_own():
    layers = declared_layers()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        problems += upward_imports(relative, path.read_text(encoding="utf-8"), layers)
    assert not problems, "\n".join(problems)


def test_the_check_finds_type_only_local_and_relative_imports():
    layers = ["model", "core", "data"]
    source = (
        "from typing import TYPE_CHECKING\n"
        "import rope_llama.model.llama\n"  # allowed: model comes first
        "if TYPE_CHECKING:\n"
        "    from rope_llama.data.tokenizer import Tokenizer\n"
        "def f():\n"
        "    import rope_llama.data.cache\n"
        "from ..data import sources\n"
        "from rope_llama import data, CONFIGS\n"
        "from . import checks\n"  # its own package
    )
    problems = upward_imports(Path("rope_llama/core/checkpoint.py"), source, layers)
    assert [p.split(" imports ")[0].rsplit(":", 1)[1] for p in problems] == ["4", "6", "7", "8"]
    assert problems[0] == (
        "rope_llama/core/checkpoint.py:4 imports rope_llama.data.tokenizer, but core/ comes before data/ in the layers"
    )
    top = upward_imports(Path("rope_llama/__init__.py"), "from rope_llama.model import llama\n", layers)
    assert len(top) == 1


MAX_LINES = 600  # a file longer than this holds more than one concern: split it by concern


def test_no_source_file_is_longer_than_600_lines():
    checkout = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(checkout / "tests").glob("*.py"), *(checkout / "scripts").glob("*.py"),
             *(checkout / "tools").glob("*.py"), *checkout.glob("*.py")]  # fmt: skip
    long = {
        str(f.relative_to(checkout)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize(
    "target",
    [
        "rope_llama.inference.samples.TextSample",  # where it lived until the callbacks took it in
        "inference.samples.TextSample",  # a checkout from before the rope_llama package
    ],
)
def test_an_older_runs_sample_config_still_builds(target, tmp_path):
    saved = OmegaConf.create(
        {
            "sample": {
                "_target_": target,
                "run_dir": str(tmp_path),
                "prompt": "ROMEO:",
                "max_new_tokens": 4,
                "temperature": 0.8,
                "top_k": 50,
            }
        }  # fmt: skip
    )
    assert current_target(target) == "rope_llama.training.callbacks.TextSample"
    sample = build(saved.sample, tokenizer=None)
    assert isinstance(sample, TextSample) and sample.max_new_tokens == 4
    assert saved.sample._target_ == target  # build maps a copy: the loaded config is left as it was
