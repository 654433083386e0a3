"""bench's warning that its figures are unreliable on a loaded machine (cli/_reliability):
the load and the floors are forced (monkeypatch, fabricated measurements), never real load."""

import json
from argparse import Namespace

import pytest

from posenc_fast.cli import _cases, _reliability, bench

ENV = {"cpu_model": "Test CPU", "cpu_count": 2}


def _setting(threads=1, contention=False, bandwidth=20.0, gemm=100.0):
    machine = {"bandwidth_gbps": bandwidth, "gemm_gflops": {"256x32": gemm}}
    return {"threads": threads, "contention": contention, "machine": machine}


def test_quiet_machine_with_usual_floors_is_reliable(tmp_path):
    path = str(tmp_path / "h.json")
    first = _reliability.assess([_setting()], ENV, "cpu", 0.3, 1.2, path)
    assert first["reliable"] and first["compared_runs"] == {
        _reliability.setting_key(ENV, "cpu", _setting()): 0
    }
    assert "no earlier run" in _reliability.summary(first)[0]
    # the next runs compare with the first: 10% slower is noise, not a warning
    again = _reliability.assess([_setting(bandwidth=18.0, gemm=90.0)], ENV, "cpu", 0.3, 1.2, path)
    assert again["reliable"] and again["warnings"] == [] and _reliability.summary(again) == []
    assert list(again["compared_runs"].values()) == [1]


def test_load_above_the_cpus_at_the_start_warns(tmp_path):
    r = _reliability.assess([_setting()], ENV, "cpu", 5.3, 1.0, str(tmp_path / "h.json"))
    assert not r["reliable"]
    (line,) = _reliability.summary(r)
    assert line.startswith("WARNING: these figures are unreliable:")
    assert "load average was 5.3 when the run started, above the 2 CPUs" in line


def test_load_at_the_end_discounts_the_benchmarks_own_threads(tmp_path):
    path = str(tmp_path / "h.json")
    settings = [_setting(2), _setting(2, contention=True)]
    # 2 threads + the busy process: a load of 5 is 2 beyond them, not above 2 CPUs
    assert _reliability.assess(settings, ENV, "cpu", 0.5, 5.0, path)["reliable"]
    r = _reliability.assess(settings, ENV, "cpu", 0.5, 6.5, path)
    assert not r["reliable"] and "3.5 beyond the benchmark's own 3 thread(s)" in r["warnings"][0]


def test_floors_far_below_the_usual_ones_warn(tmp_path):
    path = str(tmp_path / "h.json")
    for bw in (20.0, 22.0, 19.0):
        _reliability.assess([_setting(bandwidth=bw)], ENV, "cpu", 0.1, 0.1, path)
    r = _reliability.assess([_setting(bandwidth=6.0, gemm=30.0)], ENV, "cpu", 0.1, 0.1, path)
    assert not r["reliable"]
    (warning,) = r["warnings"]
    assert "far below this machine's usual ones (1 thread(s))" in warning
    assert (
        "bandwidth GB/s 6 (usual 20)" in warning and "GEMM 256x32 GFLOP/s 30 (usual 100)" in warning
    )
    # another setting (2 threads, another machine) has its own history: nothing to compare
    other = _reliability.assess([_setting(2, bandwidth=6.0)], ENV, "cpu", 0.1, 0.1, path)
    assert other["reliable"]
    with open(path) as f:
        data = json.load(f)
    assert len(data) == 2 and len(data[_reliability.setting_key(ENV, "cpu", _setting())]) == 4


def test_history_is_bounded_and_survives_damage(tmp_path):
    path = tmp_path / "h.json"
    path.write_text("{not json")
    for _ in range(_reliability.HISTORY_RUNS + 5):
        assert _reliability.assess([_setting()], ENV, "cpu", None, None, str(path))["reliable"]
    (runs,) = json.loads(path.read_text()).values()
    assert len(runs) == _reliability.HISTORY_RUNS


def test_history_location(monkeypatch, tmp_path):
    monkeypatch.delenv("POSENC_FAST_BENCH_HISTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _reliability.history_path() == str(tmp_path / "posenc_fast" / "bench_floors.json")
    monkeypatch.setenv("POSENC_FAST_BENCH_HISTORY", "off")
    assert _reliability.history_path() is None
    r = _reliability.assess([_setting()], ENV, "cpu", None, None)
    assert r["reliable"] and r["history"] is None and not (tmp_path / "posenc_fast").exists()


def test_unwritable_history_is_a_note_not_a_failure(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = _reliability.assess([_setting()], ENV, "cpu", 0.1, 0.1, str(blocker / "sub" / "h.json"))
    assert r["reliable"] and r["note"].startswith("floor history not saved")


@pytest.mark.parametrize("loaded", [False, True])
def test_bench_cli_prints_and_saves_the_warning(tmp_path, monkeypatch, capsys, loaded):
    """The real CLI path with the load average forced: the warning line in the output and
    the "reliability" record in the JSON."""
    monkeypatch.setenv("POSENC_FAST_BENCH_HISTORY", str(tmp_path / "h.json"))
    load = 64.0 if loaded else 0.0
    monkeypatch.setattr(_reliability, "load_average", lambda: load)
    small = [_cases.encoding_case("sinusoidal", 64, 8, "cpu")]
    monkeypatch.setattr(_cases, "cases", lambda quick, device, ops: small)
    path = tmp_path / "r.json"
    args = Namespace(
        device="cpu", quick=True, ops="sinusoidal", modes="fwd", floater_sizes=None,
        json=str(path), plot=None, no_compile=True, max_autotune=False,
        compile_timeout=300.0, min_time=0.01, threads="1", contention=False,
    )  # fmt: skip
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    rel = json.loads(path.read_text())["reliability"]
    assert rel["reliable"] is not loaded and rel["load_start"] == load
    if loaded:
        assert "WARNING: these figures are unreliable: the load average was 64.0" in out
        assert rel["warnings"] and "64.0" in rel["warnings"][0]
    else:
        assert "WARNING" not in out and rel["warnings"] == []
