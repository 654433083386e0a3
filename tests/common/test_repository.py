"""Repository-level promises: CI runs the README's test command; layout rules hold."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in _readme_commands() if "pytest" in c and "setup_venv.sh test" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd.strip() in ci, f"README test command {test_cmd!r} not found in .ci/run"


def test_readme_quick_start_benchmarks_on_cpu():
    assert any("bench --quick" in c and "setup_venv.sh" in c for c in _readme_commands())


def test_install_never_pins_torch_exactly():
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", pyproject, flags=re.M | re.S).group(1)
    assert "torch" in deps and "torch==" not in deps
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "constraints.txt" in (ROOT / "tools" / "setup_venv.sh").read_text()


def test_triton_kernels_are_not_a_top_level_package(tmp_path):
    """Installed, the kernels are posenc_fast.triton_kernels; `triton_kernels` stays free
    for the Triton project's own package (checked outside the source tree)."""
    import subprocess
    import sys

    code = (
        "import importlib.util, posenc_fast.triton_kernels as k; "
        "spec = importlib.util.find_spec('triton_kernels'); "
        "print(k.__name__, spec.origin if spec else None)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    name, origin = out.stdout.split()
    assert name == "posenc_fast.triton_kernels"
    assert origin == "None" or not origin.startswith(str(ROOT)), origin
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"posenc_fast.triton_kernels" = "triton_kernels"' in pyproject


def test_readme_python_examples_run():
    """Every ```python block of the README runs, in order, in one namespace (blocks that
    need timm, transformers or another optional package only where it is installed, as in
    CI: then this test skips after the others). The documentation pages' blocks:
    tests/common/test_docs.py, the same way."""
    import pytest
    from _markdown import run_blocks, skip_reason

    skipped = run_blocks(ROOT / "README.md", min_blocks=4)
    if skipped:
        pytest.skip(skip_reason(ROOT / "README.md", skipped))


def test_public_functions_do_not_shadow_modules():
    """`pf.floater` is the function; the module behind it has its own name, so
    `import posenc_fast.ops.floater` and mock.patch strings work."""
    import importlib

    import posenc_fast as pf

    for name in ("lff", "floater", "sinusoidal", "dft"):
        assert callable(getattr(pf, name)) and not isinstance(getattr(pf, name), type(pf))
        try:
            importlib.import_module(f"posenc_fast.{name}")
        except ModuleNotFoundError:
            continue
        raise AssertionError(f"posenc_fast.{name} is both a module and a public function")
    assert importlib.import_module("posenc_fast.ops.floater").Floater is pf.Floater
