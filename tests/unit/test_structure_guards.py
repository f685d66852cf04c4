"""Guards that keep the tree's structure as it was meant: each asks one question of the source
(read with `ast` / `tokenize`, nothing imported) and names every place that breaks the rule.

- the platform is asked through its object, never compared by name, outside deepinfer/platforms/;
- a speculative method or verification mode is resolved once (spec_decode/method.py, from the
  strings config.py parses), never compared as a string where it is used;
- environment variables are read in deepinfer/envs.py only;
- no Python file of the project is over 600 lines;
- no measured figure sits in a code comment or docstring (figures go to
  docs/benchmarks/design-measurements.md with their date, where they can be re-measured);
- deepinfer/types/ imports nothing of deepinfer above it.
The import cycles (lazy and type-only imports included) are test_import_cycles.py's.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deepinfer"
MAX_LINES = 600

PLATFORM_NAMES = {"cuda", "cpu"}
SPEC_STRINGS = {"ngram", "draft_model", "mtp", "replay", "adaptive", "fixed"}
# Where each string family is at home.
PLATFORM_HOME = ("deepinfer/platforms/", "deepinfer/envs.py")
SPEC_HOME = ("deepinfer/config.py", "deepinfer/spec_decode/method.py")
ENV_HOME = ("deepinfer/envs.py",)

# A measured figure: a time, a rate, a bandwidth, a ratio to an anchor, a percentage, the card it
# ran on, or a date. "100 %" as a plain bound and counts of things are not figures, so numbers
# must carry a unit of measure to match.
FIGURE = re.compile(
    r"\b\d[\d.,]*\s?(ms|us|µs|ns|tok/s|req/s|GB/s|TB/s|GiB/s|TFLOP/s)(?![\w/])"
    r"|\b\d+\.\d+\s?x\b|\b\d[\d.,]*\s?x (faster|slower|roofline|floor|the )"
    r"|\b\d+(\.\d+)?\s?% (of|faster|slower|more|less|fewer|lower|higher)\b"
    r"|\bH[12]00\b"
    r"|\b20\d\d-[01]\d-[0-3]\d\b")


def project_files(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.split()]


def package_files() -> list[tuple[str, ast.Module]]:
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        files.append((rel, ast.parse(path.read_text(encoding="utf-8"), rel)))
    return files


def _constants(node: ast.AST) -> set[str]:
    """The string constants a comparison operand is, or holds (a tuple / set / list of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def _compared_strings(tree: ast.Module):
    """(line, the non-constant operand, the strings it is compared with) for every comparison."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = set().union(*map(_constants, operands))
            others = [o for o in operands if not _constants(o)]
            if strings and others:
                yield node.lineno, others, strings


def _is_device_type(node: ast.AST) -> bool:
    """`x.device.type` / `device.type`: a tensor's device, which is a fact of the tensor, not a
    question about the platform."""
    return isinstance(node, ast.Attribute) and node.attr == "type"


def test_no_platform_name_comparison_outside_platforms():
    offenders = []
    for rel, tree in package_files():
        if rel.startswith(PLATFORM_HOME):
            continue
        for line, others, strings in _compared_strings(tree):
            if strings & PLATFORM_NAMES and not all(_is_device_type(o) for o in others):
                offenders.append(f"{rel}:{line}")
    assert not offenders, ("ask the Platform object (platforms/base.py) instead of comparing its name: "
                           f"{offenders}")


def _names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}


def _is_spec_setting(node: ast.AST) -> bool:
    """An operand that reads a speculative method or verification mode (`spec.method`,
    `config.verification`, a local `method`), not any string (a checkpoint's "mtp" layer names)."""
    return any("method" in name or "verification" in name for name in _names(node))


def test_no_speculative_method_string_comparison_outside_its_home():
    offenders = []
    for rel, tree in package_files():
        if rel in SPEC_HOME:
            continue
        for line, others, strings in _compared_strings(tree):
            if strings & SPEC_STRINGS and any(_is_spec_setting(o) for o in others):
                offenders.append(f"{rel}:{line} {sorted(strings & SPEC_STRINGS)}")
    assert not offenders, ("ask the resolved method object (spec_decode/method.py) instead of comparing "
                           f"strings: {offenders}")


def test_environment_read_only_in_envs():
    offenders = []
    for rel, tree in package_files():
        if rel in ENV_HOME:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                    and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb")):
                offenders.append(f"{rel}:{node.lineno} os.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                    a.name in ("environ", "getenv") for a in node.names):
                offenders.append(f"{rel}:{node.lineno} from os import environ/getenv")
    assert not offenders, f"read environment variables through deepinfer/envs.py: {offenders}"


def test_no_python_file_over_the_limit():
    big = {}
    for path in project_files("*.py"):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES:
            big[path.relative_to(ROOT).as_posix()] = lines
    assert not big, f"split these by responsibility (over {MAX_LINES} lines): {big}"


def comment_and_docstring_lines(path: Path):
    """(line number, text) of every comment and docstring line of a Python file."""
    source = path.read_text(encoding="utf-8")
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        text = None
        if tok.type == tokenize.COMMENT:
            text = tok.string
        elif (tok.type == tokenize.STRING and previous in (None, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)
              and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            text = tok.string   # a string standing as a statement: a docstring
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            previous = tok.type
        if text is not None:
            for i, line in enumerate(text.splitlines()):
                yield tok.start[0] + i, line


def test_no_measured_figure_in_a_comment():
    found = []
    for path in project_files("deepinfer/*.py") + project_files("recipe/*.py"):
        for line_no, text in comment_and_docstring_lines(path):
            if FIGURE.search(text):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{line_no}: {text.strip()[:90]}")
    assert not found, ("say why in words and move the figure, with its date, to "
                       "docs/benchmarks/design-measurements.md:\n" + "\n".join(found))


@pytest.mark.parametrize("text, is_figure", [
    ("# 1.54 s to compute, 2.3 s to load", False),   # seconds alone are too common a word to match
    ("# 0.6-0.9 ms of a 5 ms step", True),
    ("# measured on an H200", True),
    ("# 371 against 323 TFLOP/s", True),
    ("# 0.97x roofline", True),
    ("# a 2x larger pool", False),
    ("# at 0.97 x roofline", True),
    ("# coverage below 100 %", False),
    ("# the store cost 31 % of offline throughput", True),
    ("# Rank 0 uses the endpoint", False),
    ("# (tests/unit/test_sdpa_extend.py, 2026-12-02)", True),
])
def test_the_figure_pattern(text, is_figure):
    assert bool(FIGURE.search(text)) == is_figure


# deepinfer.multimodal.config and deepinfer.lora.config: EngineConfig's image and LoRA settings,
# parts of deepinfer.config kept in their packages (they import nothing of deepinfer either).
ALLOWED_BELOW_TYPES = {"deepinfer.config", "deepinfer.sampling_params", "deepinfer.pooling_params",
                       "deepinfer.outputs", "deepinfer.multimodal.config", "deepinfer.lora.config"}


def test_shared_types_import_nothing_above_them():
    """deepinfer/types/ is the bottom of the tree: every layer imports it, so it imports no other
    part of deepinfer (lazily or for type checking either), only the user-facing vocabulary that
    itself imports nothing of deepinfer beyond that vocabulary."""
    offenders = []
    for path in sorted((PACKAGE / "types").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if (name.split(".")[0] == "deepinfer" and not name.startswith("deepinfer.types")
                        and name not in ALLOWED_BELOW_TYPES):
                    offenders.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {name}")
    assert not offenders, offenders
    for leaf in ALLOWED_BELOW_TYPES:
        tree = ast.parse((ROOT / (leaf.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m.split(".")[0] == "deepinfer" and m not in ALLOWED_BELOW_TYPES}, leaf


def test_test_modules_have_unique_basenames():
    """pytest imports test files without packages by basename ("rootdir-relative" needs
    __init__.py files this tree does not have): two test_x.py in different folders make the
    second one's collection fail, and with it the whole run."""
    seen: dict[str, str] = {}
    clashes = []
    for path in project_files("*test_*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {rel}")
        seen.setdefault(path.name, rel)
    assert not clashes, f"rename one of each pair (pytest collects by basename): {clashes}"
