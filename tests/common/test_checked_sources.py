"""tools/checked_sources.py: a check runs once per state of what it reads.

CI skips a portability check whose inputs (files and tools' versions) passed before, as
recorded in tools/checked_sources.tsv; these tests drive the tool on a throwaway git
repository with a check of their own, so that a skip can only come from the record."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    path = ROOT / "tools" / "checked_sources.py"
    spec = importlib.util.spec_from_file_location("checked_sources", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def tool(tmp_path, monkeypatch):
    mod = _load()
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "a.c").write_text("int a;\n")
    (repo / ".gitignore").write_text("src/*.o\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.setattr(mod, "ROOT", repo)
    monkeypatch.setattr(mod, "RECORD", repo / "record.tsv")
    state = {"tool": "1.0", "rc": 0}
    runs = repo / "runs"
    command = [sys.executable, "-c", f"import sys; open({str(runs)!r}, 'a').write('x'); "
               f"sys.exit(int(open({str(repo / 'rc')!r}).read()))"]  # fmt: skip

    def demo():
        (repo / "rc").write_text(str(state["rc"]))
        return {"inputs": ["src"], "tools": {"cc": state["tool"]}, "command": command}

    monkeypatch.setattr(mod, "CHECKS", {"demo": demo})
    mod.runs = lambda: len(runs.read_text()) if runs.exists() else 0
    mod.state, mod.repo = state, repo
    return mod


def test_a_passing_check_is_recorded_and_then_skipped(tool, capsys):
    assert tool.run("demo") == 0 and tool.runs() == 1
    (line,) = tool.RECORD.read_text().splitlines()
    check, digest, _date, _commit, _seconds, tools = line.split("\t")
    assert check == "demo" and len(digest) == 64 and tools == "cc 1.0"
    assert tool.run("demo") == 0 and tool.runs() == 1  # skipped: nothing ran
    assert "skipped: these inputs passed on" in capsys.readouterr().out


def test_a_changed_source_or_tool_version_runs_it_again(tool):
    tool.run("demo")
    (tool.repo / "src" / "a.c").write_text("int a = 1;\n")
    assert tool.run("demo") == 0 and tool.runs() == 2
    (tool.repo / "src" / "b.h").write_text("")  # a new (untracked, not ignored) file
    assert tool.run("demo") == 0 and tool.runs() == 3
    tool.state["tool"] = "1.1"
    assert tool.run("demo") == 0 and tool.runs() == 4
    assert len(tool.RECORD.read_text().splitlines()) == 4


def test_ignored_build_outputs_do_not_change_the_key(tool):
    before = tool.key(tool.CHECKS["demo"]())
    (tool.repo / "src" / "a.o").write_bytes(b"\0")
    assert tool.key(tool.CHECKS["demo"]()) == before


def test_a_failing_check_is_not_recorded_and_fails(tool):
    tool.state["rc"] = 3
    assert tool.run("demo") == 3 and not tool.RECORD.exists()
    assert tool.run("demo") == 3 and tool.runs() == 2


def test_a_missing_tool_means_no_key_and_the_check_runs(tool):
    tool.state["tool"] = None
    assert tool.key(tool.CHECKS["demo"]()) is None
    assert tool.run("demo") == 0 and tool.run("demo") == 0 and tool.runs() == 2


def test_forced_runs_and_unknown_names(tool, monkeypatch):
    tool.run("demo")
    monkeypatch.setenv("CHECKED_SOURCES_FORCE", "1")
    assert tool.run("demo") == 0 and tool.runs() == 2
    with pytest.raises(SystemExit):
        tool.main(["run", "nonesuch"])


def test_skip_says_whether_every_check_named_passed_on_these_inputs(tool, capsys):
    assert tool.main(["skip", "demo"]) == 1 and tool.runs() == 0  # nothing recorded, no run
    tool.run("demo")
    assert tool.main(["skip", "demo"]) == 0 and tool.runs() == 1
    assert "== demo: skipped: these inputs passed on" in capsys.readouterr().out
    (tool.repo / "src" / "a.c").write_text("int a = 2;\n")
    assert tool.main(["skip", "demo"]) == 1


def test_all_except(tool, monkeypatch):
    ran = []
    monkeypatch.setitem(tool.CHECKS, "other", tool.CHECKS["demo"])
    monkeypatch.setattr(tool, "run", lambda check: ran.append(check) or 0)
    assert tool.main(["run", "--all", "--except", "other"]) == 0 and ran == ["demo"]
    with pytest.raises(SystemExit):
        tool.main(["run", "--all", "--except", "nonesuch"])


def test_ci_runs_every_check_through_the_record():
    """The oldest-torch check runs beside the suite (when its inputs are not recorded), the
    others after it; none twice."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 tools/checked_sources.py skip oldest-torch && exit 0" in ci
    assert "tools/checked_sources.py run --all --except oldest-torch" in ci
    assert set(_load().CHECKS) == {
        "cuda",
        "aarch64",
        "triton",
        "triton-3.1.0",
        "triton-3.6.0",
        "tsan",
        "oldest-torch",
    }


def test_the_oldest_torch_key_reads_the_package_and_its_packaging():
    """A change anywhere in what a plain `pip install .` ships makes the check run again."""
    mod = _load()
    spec = mod.CHECKS["oldest-torch"]()
    names = {p.relative_to(ROOT).as_posix() for p in mod._files(spec["inputs"])}
    for name in ("posenc_fast/__init__.py", "posenc_fast/ops/lff/api.py",
                 "triton_kernels/lff_forward.py", "csrc/module.cpp", "setup.py",
                 "pyproject.toml", "tools/check_oldest_torch.sh",
                 "tests/common/test_extension_build.py"):  # fmt: skip
        assert name in names, name
    assert spec["tools"]["torch"] == "2.5.1" and spec["command"] == ["tools/check_oldest_torch.sh"]
