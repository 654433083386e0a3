"""pytest-benchmark's configuration: timings never share the machine with another test
process, so `-n auto` (pyproject's addopts, which parallelise the test suite) starts none
here."""


def pytest_xdist_auto_num_workers(config):
    return 0
