"""The documentation site (docs/, mkdocs.yml): its examples run, it builds with
`mkdocs build --strict` where mkdocs is installed (tools/check_docs.sh installs it), and
neither it nor the README cites a file the repository does not hold; no file of the
repository cites an issue number."""

import os
import re
import subprocess
import sys

import pytest
from _markdown import ROOT, python_blocks, run_blocks, skip_reason

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FOLDERS = ("benchmarks", "tools", "csrc", "docs")  # where a bare `NOTES.md` may live
# installed names of folders the repository keeps elsewhere (pyproject.toml's package-dir)
INSTALLED_AS = {"posenc_fast/csrc": "csrc", "posenc_fast/triton_kernels": "triton_kernels"}
PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p)]
# "issue" or "issues", then a number after a space, "#" or "-": a reference the
# repository cannot resolve (benchmarks/results/'s folder names are paths it holds);
# in file names "_" or nothing between them too
ISSUE_NUMBER = re.compile(r"\bissues?(?: #?|#|-)\d+", flags=re.I)
ISSUE_IN_NAME = re.compile(r"issues?[\s_#-]*\d+", flags=re.I)


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_python_examples_run(page):
    """Every ```python block of a page runs, in order, in one namespace per page; blocks
    that need an optional package or a GPU only where it is there (then this skips after
    the others). The README's blocks: test_repository.py."""
    skipped = run_blocks(page)
    if skipped:
        pytest.skip(skip_reason(page, skipped))


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert f": {page.relative_to(DOCS)}" in nav, f"{page} is not in mkdocs.yml's nav"


def _cited_paths(text: str) -> set[str]:
    """Relative link targets and `code` spans that name a file or folder of the repository."""
    links = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)}
    links = {t for t in links if t and "://" not in t and not t.startswith("mailto:")}
    tops = "|".join((*FOLDERS, "tests", "posenc_fast", "triton_kernels", "examples", r"\.ci"))
    spans = set(re.findall(rf"`((?:{tops})/[\w./-]*)`", text))
    files = set(re.findall(r"`([\w/.-]+\.md)`", text))  # `RESULTS.md`, `benchmarks/NOTES.md`
    return links | {("./" + s) for s in spans | files}


@pytest.mark.parametrize("doc", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_docs_cite_only_what_the_repository_holds(doc):
    """Links and file names resolve in this checkout (links relative to the page, `code`
    paths relative to the repository root), and no page cites an issue number."""
    text = doc.read_text()
    absent = []
    for cited in sorted(_cited_paths(text)):
        base = ROOT if cited.startswith("./") else doc.parent
        path = cited[2:] if cited.startswith("./") else cited
        for installed, source in INSTALLED_AS.items():  # where pyproject.toml installs them
            if path.startswith(installed):
                path = source + path[len(installed) :]
        bare = "/" not in path and cited.startswith("./")  # `NOTES.md` after benchmarks/...
        if bare and any((ROOT / folder / path).exists() for folder in FOLDERS):
            continue
        if not (base / path).exists():
            absent.append(cited)
    assert not absent, f"{doc.name} cites what the repository does not hold: {absent}"
    assert not ISSUE_NUMBER.search(text), f"{doc.name} cites an issue number"


def test_no_file_cites_an_issue_number():
    """The repository stands alone: no file (code, comments, docstrings, tests, pages, file
    names) points at an issue by number; each says the thing itself. Every file git lists
    (tracked, and untracked ones not ignored) except benchmarks/results/, the records of
    past runs, and binary files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        cwd=ROOT,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    hits = []
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        if name.startswith("benchmarks/results/"):
            continue
        if ISSUE_IN_NAME.search(name):
            hits.append(f"{name}: the file name")
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if ISSUE_NUMBER.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not hits, "issue numbers cited (say the thing itself instead):\n" + "\n".join(hits)


def test_mkdocs_build_strict(tmp_path):
    """The site builds without a warning (broken links and anchors, pages missing from the
    navigation, docstrings the API reference cannot parse)."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="no docs extra here (tools/check_docs.sh installs it)")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_every_environment_variable_is_in_the_table():
    """The package's environment variables (every POSENC_FAST_ name its sources hold, the
    C++ and setup.py's included) are the rows of docs/installation.md's table, each with
    its default: at most twelve."""
    out = subprocess.run(
        ["git", "ls-files", "posenc_fast", "triton_kernels", "csrc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [ROOT / f for f in out if f.endswith((".py", ".cpp", ".h", ".cu", ".cuh"))]
    used = set()
    for path in [*files, ROOT / "setup.py"]:
        used |= set(re.findall(r"POSENC_FAST_[A-Z0-9_]*", path.read_text()))
    page = (DOCS / "installation.md").read_text()
    table = page.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(POSENC_FAST_[A-Z0-9_]+)` \| ([^|]+) \|", table, flags=re.M))
    assert used == set(rows), (sorted(used - set(rows)), sorted(set(rows) - used))
    assert len(rows) <= 12 and all(d.strip() for d in rows.values())
