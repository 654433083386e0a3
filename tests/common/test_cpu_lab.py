"""The CPU benchmark lab (benchmarks/cpu_lab.py): bench's cases with a busy process pinned
to one core (benchmarks/_contention.py), and its warning that its figures are unreliable on
a loaded machine (benchmarks/_reliability.py: the load and the floors are forced here,
monkeypatch and fabricated measurements, never real load)."""

import json
import os

import pytest
import torch
from _lab import contention as _contention
from _lab import cpu_lab
from _lab import reliability as _reliability

from posenc_fast.cli import _cases, bench

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
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _reliability.history_path() == str(tmp_path / "posenc_fast" / "bench_floors.json")
    assert _reliability.history_path("elsewhere.json") == "elsewhere.json"
    assert _reliability.history_path("off") is None
    r = _reliability.assess([_setting()], ENV, "cpu", None, None, _reliability.history_path("off"))
    assert r["reliable"] and r["history"] is None and not (tmp_path / "posenc_fast").exists()


def test_unwritable_history_is_a_note_not_a_failure(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = _reliability.assess([_setting()], ENV, "cpu", 0.1, 0.1, str(blocker / "sub" / "h.json"))
    assert r["reliable"] and r["note"].startswith("floor history not saved")


@pytest.mark.parametrize("loaded", [False, True])
def test_lab_prints_and_saves_the_warning(tmp_path, monkeypatch, capsys, loaded):
    """The lab's command line with the load average forced: the warning line in the output
    and the "reliability" record in the JSON, the floors kept in the --history file."""
    load = 64.0 if loaded else 0.0
    monkeypatch.setattr(_reliability, "load_average", lambda: load)
    small = [_cases.encoding_case("sinusoidal", 64, 8, "cpu")]
    monkeypatch.setattr(_cases, "cases", lambda quick, device, ops: small)
    path, history = tmp_path / "r.json", tmp_path / "h.json"
    argv = ["--quick", "--ops", "sinusoidal", "--modes", "fwd", "--json", str(path), "--no-compile",
            "--min-time", "0.01", "--threads", "1", "--history", str(history)]  # fmt: skip
    assert cpu_lab.main(argv) == 0
    out = capsys.readouterr().out
    rel = json.loads(path.read_text())["reliability"]
    assert rel["reliable"] is not loaded and rel["load_start"] == load
    assert rel["history"] == str(history) and history.exists()
    if loaded:
        assert "WARNING: these figures are unreliable: the load average was 64.0" in out
        assert rel["warnings"] and "64.0" in rel["warnings"][0]
    else:
        assert "WARNING" not in out and rel["warnings"] == []


def test_lab_settings_from_flags():
    s = cpu_lab.settings_from("1,2", contention=True)
    assert s == [bench.Setting(1), bench.Setting(2), bench.Setting(2, True)]
    assert s[2].context is cpu_lab.busy_process and s[0].context is None
    one = cpu_lab.settings_from("1", contention=True)
    assert one == [bench.Setting(1), bench.Setting(1, True)]
    assert cpu_lab.settings_from(None, False) == [bench.Setting(torch.get_num_threads())]
    with pytest.raises(ValueError, match="positive"):
        cpu_lab.settings_from("0,2", False)


@pytest.mark.skipif(len(_contention.cpus()) < 2, reason="contention mode needs 2 CPUs")
def test_busy_process_is_pinned_and_always_stopped():
    with _contention.busy_cpu() as proc:
        assert proc.poll() is None
        assert os.sched_getaffinity(proc.pid) == {_contention.cpus()[-1]}
    assert proc.poll() is not None  # stopped when the block ends
    with pytest.raises(KeyboardInterrupt), _contention.busy_cpu() as proc:
        raise KeyboardInterrupt  # e.g. Ctrl-C during a measurement
    assert proc.poll() is not None


@pytest.mark.slow
@pytest.mark.skipif(len(_contention.cpus()) < 2, reason="contention mode needs 2 CPUs")
def test_lab_end_to_end_with_contention(tmp_path, monkeypatch):
    """The lab's command line, a quiet setting and a busy one, on a shrunken size set: the
    busy setting records its process, its rows their contention."""
    small = [_cases.encoding_case("dft", 128, 8, "cpu")]
    monkeypatch.setattr(_cases, "cases", lambda quick, device, ops: small)
    path = tmp_path / "r.json"
    argv = ["--quick", "--ops", "dft", "--modes", "fwd", "--json", str(path), "--no-compile",
            "--min-time", "0.01", "--threads", "1", "--contention", "--history", "off"]  # fmt: skip
    assert cpu_lab.main(argv) == 0
    data = json.loads(path.read_text())
    quiet, busy = data["settings"]
    assert not quiet["contention"] and busy["contention"] and busy["threads"] == 1
    assert busy["busy_cpu"] == _contention.cpus()[-1] and busy["busy_pid"] > 0
    by_impl = {(r["impl"], r["contention"]): r for r in data["results"]}
    assert by_impl[("torch", True)]["ms"] > 0 and by_impl[("torch", False)]["ms"] > 0
    assert data["reliability"]["history"] is None


def test_lab_refuses_contention_without_two_cpus(monkeypatch, capsys):
    monkeypatch.setattr(_contention, "cpus", lambda: [0])
    assert cpu_lab.main(["--quick", "--ops", "sinusoidal", "--contention"]) == 2
    assert "--contention needs" in capsys.readouterr().err
