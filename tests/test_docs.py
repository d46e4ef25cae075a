"""Every code block of the READMEs and docs/ runs, and every relative link in them resolves.

A block's info string says how it is checked:

- ```` ```python ```` / ```` ```bash ````: run as written, in a fresh process on the CPU (ranks through gloo or
  threads), from a temporary directory; it must exit 0.
- ```` ```python continues ````: appended to the file's previous python block, the two run as one script.
- ```` ```python gpu ```` / ```` ```bash gpu ````: needs an NVIDIA GPU: compiled (``bash -n``) on the CPU, run by
  the GPU suite (``pytest -m gpu``).
- ```` ```python norun ```` / ```` ```bash norun ````: shown, not run (installs, nox itself, multi-GPU scripts):
  compiled, and every ``./path`` or ``scripts/...`` it names must exist.
- ```` ```python fragment ````: an excerpt of a larger program (names defined elsewhere), not a program: compiled
  only. Their number may only go down (``MAX_FRAGMENTS``).

Blocks that another test already runs are listed in ``RUN_ELSEWHERE`` and not run twice. Languages other than
python/bash/sh (text, diff, cpp, cuda, cmake, pictures) are not code to run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *(ROOT / p / "README.md" for p in ("ep-layout", "ep-jit", "ep-core", "ep-torch")),
    *sorted((ROOT / "packages").glob("*/README.md")),
    *sorted((ROOT / "ep-torch" / "docs").glob("*.md")),
]
RUNNABLE = {"python", "bash", "sh"}
TAGS = {"gpu", "norun", "continues", "fragment"}
NOT_RUN = {"gpu", "norun", "fragment"}
# blocks still excerpts (ep-torch, ep-core, ep-jit, the native packages): turn them into programs
MAX_FRAGMENTS = 11

# (file, section heading, a line the block must contain or None) -> the test that runs those blocks
RUN_ELSEWHERE = {
    (
        "ep-torch/README.md",
        "## Example: DeepEP's usage, with `ep_torch`",
        None,
    ): "ep-torch/tests/test_torch_readme.py",
    (
        "ep-torch/README.md",
        "## DeepEP V1 `Buffer`",
        "# was: from deep_ep import Buffer",
    ): "ep-torch/tests/test_torch_legacy_readme.py",
}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    tags: frozenset[str]
    section: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    section = ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.strip()
        m = re.match(r"^(`{3,})\s*(\S*)\s*(.*)$", line)
        if m:
            fence, lang, rest = m.groups()
            j = i + 1
            while j < len(lines) and not lines[j].startswith(fence):
                j += 1
            out.append(
                Block(path, i + 1, lang, frozenset(rest.split()), section, "\n".join(lines[i + 1 : j]) + "\n")
            )
            i = j + 1
            continue
        i += 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
CODE = [b for b in ALL if b.lang in RUNNABLE]


def _elsewhere(b: Block) -> str | None:
    rel = b.path.relative_to(ROOT).as_posix()
    for (file, section, needle), test in RUN_ELSEWHERE.items():
        if rel == file and b.section == section and (needle is None or needle in b.code):
            return test
    return None


def _scripts() -> list[tuple[Block, str]]:
    """The python/bash blocks to run here: `continues` blocks joined to the block before them."""
    out: list[tuple[Block, str]] = []
    for b in CODE:
        if b.tags & NOT_RUN or _elsewhere(b):
            continue
        if "continues" in b.tags:
            assert out and out[-1][0].path == b.path, f"{b.id}: `continues` follows no block of its file"
            first, code = out.pop()
            out.append((first, code + "\n" + b.code))
        else:
            out.append((b, b.code))
    return out


def test_every_block_has_a_known_tag():
    for b in ALL:
        if b.lang in RUNNABLE:
            assert b.tags <= TAGS, f"{b.id}: unknown tags {sorted(b.tags - TAGS)}"
            assert len(b.tags & NOT_RUN) <= 1, b.id
        else:
            assert not b.lang or b.lang.isidentifier(), f"{b.id}: odd info string {b.lang!r}"


def test_the_docs_have_code_and_almost_all_of_it_runs():
    runs = _scripts()
    assert len(runs) >= 8, [b.id for b, _ in runs]
    shown = [b.id for b in CODE if "norun" in b.tags]
    assert len(shown) <= 8, f"too many blocks that never run: {shown}"
    fragments = [b.id for b in CODE if "fragment" in b.tags]
    assert len(fragments) <= MAX_FRAGMENTS, f"new excerpts: write a program instead: {fragments}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("EPKIT_NATIVE_LAUNCH", "0")  # no driver here: the fallback's warning is not the example's
    return env


@pytest.mark.parametrize("block,code", _scripts(), ids=lambda v: v.id if isinstance(v, Block) else None)
def test_block_runs(block: Block, code: str, tmp_path: Path):
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    else:
        script = tmp_path / "block.sh"
        script.write_text("set -euo pipefail\n" + code)
        cmd = ["bash", str(script)]
    proc = subprocess.run(
        cmd,
        cwd=ROOT if block.lang != "python" else tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("block", [b for b in CODE if b.tags & NOT_RUN], ids=lambda b: b.id)
def test_block_not_run_here_compiles(block: Block):
    if block.lang == "python":
        compile(block.code, block.id, "exec")
    else:
        proc = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.id}: {proc.stderr}"
    for ref in re.findall(r"(?<![\w/.])(\./[\w./-]+|scripts/[\w./-]+|benchmarks/[\w./-]+)", block.code):
        path = ref.rstrip(".").split("[")[0]
        assert (ROOT / path).exists() or (block.path.parent / path).exists(), (
            f"{block.id}: {ref} does not exist"
        )


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("block", [b for b in CODE if "gpu" in b.tags], ids=lambda b: b.id)
def test_gpu_block_runs(block: Block, tmp_path: Path):
    script = tmp_path / ("block.py" if block.lang == "python" else "block.sh")
    script.write_text(block.code)
    cmd = [sys.executable, str(script)] if block.lang == "python" else ["bash", "-e", str(script)]
    proc = subprocess.run(
        cmd, cwd=tmp_path if block.lang == "python" else ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_run_elsewhere_tests_exist():
    for (file, section, _needle), test in RUN_ELSEWHERE.items():
        assert (ROOT / test).is_file(), test
        assert any(b.section == section for b in ALL if b.path == ROOT / file), (file, section)


# ------------------------------------------------------------------------------------------------------- links
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"^#{1,6} ", line):
            continue
        slug = _slug(line)
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert not bad, bad


# ------------------------------------------------------------------------------------------ troubleshooting
TROUBLE = ROOT / "docs" / "troubleshooting.md"
SOURCES = [
    p
    for top in ("ep-layout", "ep-jit", "ep-core", "ep-torch", "packages")
    for p in (ROOT / top).glob("**/src/**/*.py")
]


def test_every_environment_variable_is_documented():
    text = TROUBLE.read_text()
    names = {n for p in SOURCES for n in re.findall(r"\bEPKIT_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert len(names) > 20 and not missing, missing


def test_every_error_class_is_documented():
    text = TROUBLE.read_text()
    names = {
        n for p in SOURCES for n in re.findall(r"^class (\w+(?:Error|Warning))\(", p.read_text(), flags=re.M)
    }
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert len(names) > 20 and not missing, missing


def test_ci_runs_the_readmes_test_command():
    """`.ci/run` runs the README's Quick start lines for the tests verbatim (the venv line and `nox -t ci`)."""
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") :]
    lines = [ln.split("#")[0].strip() for ln in quick.split("```")[1].splitlines()[1:]]
    wanted = [ln for ln in lines if ("venv" in ln and "pip install" in ln) or "nox -t ci" in ln]
    assert len(wanted) == 2, lines
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    for line in wanted:
        assert line in ci, f"{line!r} is not in .ci/run"
