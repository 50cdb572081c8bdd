"""benchmarks/report.py: docs/benchmarks.md and the README's results come from the benchmarks' records alone."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def modules(load_benchmark):
    return load_benchmark("bench_common"), load_benchmark("report")


def test_a_recorded_run_appears_with_its_date_commit_machine_and_command(modules, tmp_path, monkeypatch):
    common, report = modules
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "source_commit", lambda: "abc1234")
    monkeypatch.setattr(common, "machine_name", lambda device="cpu": "a test CPU, 2 cores")
    common.record_result("grpo_vs_trl", {"step_time_ratio": 4.2, "polo step (s)": 9.4}, ["--rounds", "2"])
    common.record_result("grpo_vs_trl", {"step_time_ratio": 5.0, "polo step (s)": 8.0}, ["--rounds", "3"])
    records = report.read_records()
    newest = records["grpo_vs_trl"][0]
    assert newest["commit"] == "abc1234" and newest["machine"] == "a test CPU, 2 cores"
    assert newest["command"] == "python benchmarks/grpo_vs_trl.py --rounds 3" and len(newest["date"]) == 10
    page = report.document(records)
    assert "| `python benchmarks/grpo_vs_trl.py --rounds 2` |" in page and "step_time_ratio 4.2" in page
    block = report.results_block(records)
    assert "step_time_ratio 5" in block and "a test CPU, 2 cores" in block and "step_time_ratio 4.2" not in block
    readme = f"# x\n\n{report.BEGIN}\nold figures typed by hand\n{report.END}\n\nrest\n"
    assert report.readme(readme, records) == f"# x\n\n{block}\n\nrest\n"
