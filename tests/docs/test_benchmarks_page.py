"""docs/benchmarks.md is the render of the committed bench/results/*.json (so its tables
cannot drift from their data), and the renderer's handling of present, absent, unknown and
malformed result files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("render_docs", REPO / "bench" / "render_docs.py")
render_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_docs)

META = {"command": "make bench-http", "machine": "2 cores, 7.6 GiB", "loadavg": "0.52 0.61 0.7",
        "date": "2026-12-01T22:30:00Z", "commit": "abc1234"}


def test_the_committed_page_is_the_render_of_the_committed_json():
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert page == render_docs.render(), (
        "docs/benchmarks.md differs from bench/results/: run python bench/render_docs.py")


def _write(tmp: Path, name: str, data: dict) -> None:
    (tmp / name).write_text(json.dumps(data))


def test_tables_meta_and_the_link_to_the_data(tmp_path):
    _write(tmp_path, "http_load.json", {
        "meta": META, "title": "HTTP door",
        "tables": [{"title": "real replica", "columns": ["metric", "value"],
                    "rows": [["TTFT p50 ms", 623.456], ["requests", 20000], ["ok", True]],
                    "notes": "guidellm 0.8.1"}]})
    page = render_docs.render(tmp_path)
    assert "## HTTP door" in page
    assert ("`make bench-http` on 2 cores, 7.6 GiB, load average 0.52 0.61 0.7, "
            "2026-12-01T22:30:00Z, commit `abc1234`") in page
    assert "(../bench/results/http_load.json)" in page
    assert "| TTFT p50 ms | 623.456 |" in page and "| requests | 20,000 |" in page
    assert "| ok | yes |" in page and "guidellm 0.8.1" in page
    missing = page.split("## Not run yet", 1)[1]
    assert "`http_load.json`" not in missing
    assert "`cold_start.json`" in missing and "`make bench-ladder`" in missing


def test_a_file_without_tables_shows_its_scalars_and_unknown_files_follow(tmp_path):
    _write(tmp_path, "zz_new.json", {"meta": META, "served": 1463, "ttft_ms": {
        "warm_hit": {"p50": 118.0, "p99": 1175.2}}, "records": [{"a": 1}, {"a": 2}]})
    page = render_docs.render(tmp_path)
    assert "## zz new" in page
    assert "| served | 1463 |" in page and "| ttft_ms.warm_hit.p99 | 1,175 |" in page
    assert "| records[2 entries] |  |" in page
    assert page.index("## zz new") < page.index("## Not run yet")
    # the README's link goes to that section's anchor
    assert "(docs/benchmarks.md#zz-new)" in render_docs.readme_table(tmp_path)


@pytest.mark.parametrize("data,key", [
    ({"served": 1}, "meta"),
    ({"meta": {k: v for k, v in META.items() if k != "loadavg"}}, "meta.loadavg"),
    ({"meta": META, "tables": [{"columns": ["a", "b"], "rows": [[1]]}]}, "tables[0].rows[0]"),
    ({"meta": META, "tables": {"columns": []}}, "tables"),
])
def test_a_malformed_file_is_named_with_its_key(tmp_path, data, key):
    _write(tmp_path, "bad.json", data)
    with pytest.raises(render_docs.ResultError) as err:
        render_docs.render(tmp_path)
    assert err.value.key == key and err.value.path.name == "bad.json"


def test_not_json_is_named(tmp_path):
    (tmp_path / "cold_start.json").write_text("{nope")
    with pytest.raises(render_docs.ResultError) as err:
        render_docs.render(tmp_path)
    assert err.value.path.name == "cold_start.json" and err.value.key == "file"


def test_check_mode_says_when_the_page_is_stale(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(render_docs, "PAGE", tmp_path / "benchmarks.md")
    monkeypatch.setattr(render_docs, "REPO", tmp_path)
    monkeypatch.setattr(render_docs, "README", tmp_path / "README.md")
    (tmp_path / "benchmarks.md").write_text("typed by hand\n")
    assert render_docs.main(["--check"]) == 1
    assert "benchmarks.md differ from the render" in capsys.readouterr().err
    assert render_docs.main([]) == 0 and render_docs.main(["--check"]) == 0


def test_the_readme_results_table_is_the_render_of_the_committed_json():
    readme = (REPO / "README.md").read_text()
    assert readme == render_docs.with_readme_table(readme, render_docs.readme_table()), (
        "README.md's results table differs from bench/results/: run python bench/render_docs.py")


def test_the_readme_table_takes_headlines_else_first_rows(tmp_path):
    _write(tmp_path, "http_load.json", {"meta": META, "headline": [["TTFT p50 ms", 623.4]],
                                        "tables": [{"columns": ["a", "b"], "rows": [["x", 1]]}]})
    _write(tmp_path, "cold_start.json", {"meta": META, "tables": [
        {"columns": ["rung", "s"], "rows": [["eager", 9.5], ["restore", 0.53], ["a", 1],
                                            ["b", 2]]}]})
    table = render_docs.readme_table(tmp_path)
    lines = table.splitlines()
    assert lines[0] == "| benchmark | figures | measured on |"
    assert lines[2].startswith("| [Cold-start ladder") and "eager: 9.5; restore: 0.53; a: 1 |" \
        in lines[2] and "b: 2" not in lines[2]
    assert "TTFT p50 ms: 623.4 |" in lines[3]
    assert "](docs/benchmarks.md#the-http-door-beside-the-msgpack-door-guidellm-against-a-real-replica)" \
        in lines[3]
    assert "load 0.52 0.61 0.7, 2026-12-01T22:30:00Z" in lines[3]
    text = f"a\n{render_docs.README_BEGIN}\nold\n{render_docs.README_END}\nb\n"
    assert render_docs.with_readme_table(text, table) == (
        f"a\n{render_docs.README_BEGIN}\n{table}{render_docs.README_END}\nb\n")


def test_anchor_is_githubs_and_cells_read_lists_and_maps():
    assert render_docs.anchor("Cold-start ladder: boot to first token, per rung") == \
        "cold-start-ladder-boot-to-first-token-per-rung"
    assert render_docs.cell([10.62, 10.86]) == "10.62 10.86"
    assert render_docs.cell({"start": [1.0, 2.5], "end": [3, 4]}) == "start 1 2.5; end 3 4"
