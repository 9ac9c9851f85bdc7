"""The CLI on the session's Ray: `prefixflow demo --plan-only`, `run --dry-run`, `plan --out`."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import yaml

from prefixflow.cli import main as cli
from prefixflow.jobs.demo import demo_rows, demo_spec, write_demo_data


def test_demo_data_is_deterministic(tmp_path):
    assert demo_rows(seed=0) == demo_rows(seed=0) and demo_rows(seed=0) != demo_rows(seed=1)
    a = write_demo_data(tmp_path / "a").read_bytes()
    assert a == write_demo_data(tmp_path / "b").read_bytes()
    docs = {r["doc_id"] for r in demo_rows()}
    assert len(demo_rows()) == 4 * len(docs)  # every document is asked several questions
    assert demo_spec(tmp_path).output.path == str((tmp_path / "output").resolve())


def test_demo_plan_dry_run_and_plan_out(ray_local, tiny_model, tmp_path, capsys):
    # `prefixflow demo --plan-only` reuses the checkpoint folder it finds.
    assert cli(["demo", str(tiny_model.parent), "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "plan: 48 rows -> " in out and "token saving ratio" in out and "replica 1:" in out

    spec = yaml.safe_load(demo_spec(tiny_model.parent).model_dump_json())
    spec["output"]["path"] = str(tmp_path / "out")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert cli(["run", str(path), "--dry-run", "--json", "--set", "order=dfs"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{\n") :])
    assert result["dry_run"] and result["plan"]["order"] == "dfs" and result["num_rows"] == 48
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    assert cli(["plan", str(path), "--out", str(tmp_path / "plan.parquet")]) == 0
    table = pq.read_table(tmp_path / "plan.parquet")
    assert table.num_rows == 48 and {"row_id", "replica", "rank", "group_id", "prefix_len"} <= set(table.column_names)
