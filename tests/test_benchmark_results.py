"""Benchmark results as data: the stored records, their rendering, and the docs built from them."""

import json
import math
from pathlib import Path

import pytest

from benchmarks.render import RESULTS, render, render_record, update_text
from benchmarks.report import REQUIRED_KEYS, join_records, load_record, record, write_record
from deft.cli import main

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def test_render_a_result_file(tmp_path):
    rec = record(["tree", "impl", "µs", "max |diff|"],
                 [["a", "DeFT", 1234.5, 0.0], ["a", "peer", 12.345, math.nan],
                  ["b", "DeFT", 7, 1e-7]], "cpu", reps=3)
    write_record(tmp_path / "demo.json", rec)
    stored = json.loads((tmp_path / "demo.json").read_text())
    assert stored["rows"][1] == {"tree": "a", "impl": "peer", "µs": 12.345, "max |diff|": None}
    md = render("demo", tmp_path)
    caption, blank, *table = md.splitlines()
    assert caption.startswith(f"*{rec['device']}, commit {rec['commit']}, {rec['date']}")
    assert caption.endswith(f": `{rec['command']}`*") and blank == ""
    assert table == ["| tree | impl | µs    | max \\|diff\\| |",
                     "| ---- | ---- | ----- | ------------ |",
                     "| a    | DeFT | 1,234 | 0            |",
                     "| a    | peer | 12.3  | –            |",
                     "| b    | DeFT | 7     | 1e-07        |"]
    assert render_record(stored, where="impl=DeFT", columns="tree;µs", meta=False).splitlines() == [
        "| tree | µs    |", "| ---- | ----- |", "| a    | 1,234 |", "| b    | 7     |"]
    assert render_record(stored, pivot="impl", value="µs", meta=False).splitlines() == [
        "| tree | DeFT  | peer |", "| ---- | ----- | ---- |", "| a    | 1,234 | 12.3 |",
        "| b    | 7     | –    |"]
    with pytest.raises(ValueError, match="columns"):
        render_record(stored, columns="tree;nope")


def test_docs_blocks_are_filled_from_results(tmp_path):
    write_record(tmp_path / "r.json", record(["x"], [[1.5]], "cpu"))
    text = "intro\n<!-- results:r meta=no -->\nstale\n<!-- /results -->\nend\n"
    assert update_text(text, tmp_path) == "intro\n<!-- results:r meta=no -->\n| x   |\n| --- |\n| 1.5 |\n<!-- /results -->\nend\n"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_stored_results_have_the_required_keys(path):
    rec = load_record(path)
    assert all(k in rec for k in REQUIRED_KEYS) and ("gpu" in rec or "device" in rec)
    assert all(isinstance(rec[k], str) and rec[k] for k in ("commit", "date", "command"))
    assert rec["rows"] and all(isinstance(r, dict) and r for r in rec["rows"])
    render_record(rec)


def test_stored_results_exist():
    assert {"plan_cpu", "attention_cpu", "attention_h200", "e2e_cpu", "speculative_cpu"} <= {
        p.stem for p in RESULTS.glob("*.json")}


def test_docs_match_the_stored_results():
    text = DOCS.read_text()
    assert "<!-- results:" in text
    assert update_text(text) == text, "run: python -m benchmarks.render --write docs/benchmarks.md"


def test_bench_writes_a_result_record(tmp_path, capsys):
    path = tmp_path / "out" / "attention.json"
    assert main(["bench", "attention", "--device", "cpu", "--workload", "few-shot b=20",
                 "--no-flex", "--reps", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    rec = load_record(path)
    assert rec["device"] and rec["command"] and rec["threads"] >= 1 and rec["reps"] == 1
    assert [r["workload"] for r in rec["rows"]] == ["few-shot b=20"]
    assert rec["rows"][0]["tokens"] == 8000
    assert render_record(rec, meta=False).splitlines()[2].split("|")[1].strip() == "few-shot b=20"
    assert "| few-shot b=20 |" in printed


def test_join_records_keeps_each_runs_rows_and_says_how():
    first = {"gpu": "G", "commit": "abc", "date": "d1", "command": "deft bench x --workload a",
             "tflops": 700, "kernel": "k", "rows": [{"workload": "a"}], "floors": [{"w": "a"}]}
    then = {"gpu": "G", "commit": "abc", "date": "d2", "command": "deft bench x --workload b",
            "tflops": 750, "kernel": "k", "rows": [{"workload": "b"}], "floors": [{"w": "b"}],
            "notes": "n"}
    joined = join_records(join_records(first, then), {**then, "date": "d2", "tflops": 760})
    assert [r["workload"] for r in joined["rows"]] == ["a", "b", "b"]
    assert [r["w"] for r in joined["floors"]] == ["a", "b", "b"]
    assert joined["date"] == "d1 and d2"  # a date once
    assert joined["command"].split("; then ") == [first["command"], then["command"],
                                                  then["command"]]
    assert joined["tflops"] == [700, 750, 760] and joined["kernel"] == "k"
    assert joined["notes"] == "n" and first["rows"] == [{"workload": "a"}]  # inputs unchanged
    same = join_records(first, {**then, "tflops": 700, "rows": []})  # a run that ran no tree
    assert same["rows"] == first["rows"] and same["tflops"] == 700
    assert join_records(same, then)["tflops"] == [700, 700, 750]  # one value per run
    for key, other in (("commit", "def"), ("gpu", "H")):
        with pytest.raises(ValueError, match=f"a run of {key} .*a record is one machine's"):
            join_records(first, {**then, key: other})


def test_bench_append_joins_runs_into_one_record(tmp_path, capsys):
    path = tmp_path / "plan.json"
    for name in ("few-shot b=20", "speculative t=32"):
        assert main(["bench", "plan", "--workload", name, "--reps", "1", "--json", str(path),
                     "--append"]) == 0
    rec = load_record(path)
    assert [r["workload"] for r in rec["rows"]] == ["few-shot b=20", "speculative t=32"]
    assert rec["command"].count("; then ") == 1  # each run's command line (here pytest's)
    capsys.readouterr()
    assert main(["bench", "plan", "--workload", "few-shot b=20", "--append"]) == 2
    assert "give --json" in capsys.readouterr().err
    write_record(path, {**rec, "commit": "0000000"})
    assert main(["bench", "plan", "--workload", "few-shot b=20", "--json", str(path),
                 "--append"]) == 2  # before running
    assert "holds a run of commit 0000000" in capsys.readouterr().err
    other = {**rec, "device": "elsewhere"}
    write_record(path, other)
    for i, name in enumerate(("few-shot b=20", "speculative t=32")):
        assert main(["bench", "plan", "--workload", name, "--reps", "1", "--json", str(path),
                     "--append"]) == 2
        assert "a record is one machine's and one commit's" in capsys.readouterr().err
        kept = load_record(tmp_path / ("plan.run.json" if i == 0 else "plan.run2.json"))
        assert [r["workload"] for r in kept["rows"]] == [name]  # each run's record kept
    assert load_record(path) == other  # unchanged
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "plan", "--workload", "few-shot b=20", "--json",
                 str(tmp_path / "bad.json"), "--append"]) == 2
    assert "holds no result record" in capsys.readouterr().err


def _append_runs(path: str, worker: int, runs: int) -> None:
    from benchmarks.report import append_record

    for i in range(runs):
        append_record(path, {"gpu": "G", "commit": "abc", "date": f"d{worker}",
                             "command": f"run {worker}.{i}", "rows": [{"run": f"{worker}.{i}"}]})


def test_append_record_from_processes_at_once_keeps_every_run(tmp_path):
    import multiprocessing

    path = tmp_path / "sub" / "joined.json"
    path.parent.mkdir()
    path.write_text("")  # an empty file holds no record yet
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_runs, args=(str(path), w, 8)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    rec = load_record(path)
    assert sorted(r["run"] for r in rec["rows"]) == sorted(f"{w}.{i}" for w in range(6)
                                                           for i in range(8))
    assert len(rec["command"].split("; then ")) == 48


def test_append_record_that_fails_leaves_the_file_as_it_was(tmp_path):
    from benchmarks.report import append_record, record_commit

    path = tmp_path / "r.json"
    first = {"gpu": "G", "commit": "abc", "date": "d", "command": "c", "rows": [{"run": 1}]}
    append_record(path, first)
    before = path.read_text()
    assert record_commit(path) == "abc"
    for bad, err in (({**first, "commit": "def"}, ValueError),  # another commit's run
                     ({**first, "rows": [{"run": object()}]}, TypeError)):  # not JSON
        with pytest.raises(err):
            append_record(path, bad)
        assert path.read_text() == before
    path.write_text("")
    assert record_commit(path) is None  # an empty file holds no record yet
    append_record(path, first)
    assert load_record(path)["rows"] == [{"run": 1}]
