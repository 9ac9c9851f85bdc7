"""Output folders as a job leaves them, for the tests of what a resume or an overwrite may
trust there (test_output_folder_trust.py, test_fuzz_output_paths.py): real parts written by
write_part, real commit records, a _job.json; and a snapshot of everything outside a folder."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from prefixflow.operators.results.commit import COMMITS, check_job_file
from prefixflow.operators.results.write import WriteOptions, prepare_output, write_part
from prefixflow.storage import StorageOptions

FORMATS = ("jsonl", "parquet", "openai")
SUFFIX = {"jsonl": "jsonl", "parquet": "parquet", "openai": "jsonl"}


def part_table(row_ids: list[int], replica: int = 0) -> pa.Table:
    """Output rows as the engines hand them to write_part (every format's columns)."""
    n = len(row_ids)
    return pa.table(
        {
            "row_id": row_ids,
            "replica": [replica] * n,
            "_pf_rank": row_ids,
            "error": pa.nulls(n, pa.string()),
            "num_input_tokens": [3] * n,
            "_pf_computed": [3.0] * n,
            "num_generated_tokens": [1] * n,
            "generated_text": ["x"] * n,
            "generated_tokens": [[7]] * n,
            "finish_reason": ["stop"] * n,
            "custom_id": [f"req-{r}" for r in row_ids],
        }
    )


def committed_job(out: Path, fmt: str, groups: list[list[int]]) -> list[str]:
    """A job folder as a run leaves it: a _job.json and one committed part per group."""
    opts = WriteOptions(path=str(out), format=fmt)
    prepare_output(opts, overwrite=False)
    check_job_file(str(out), {"fingerprint": "ab" * 32}, StorageOptions(), resume=False)
    for ids in groups:
        write_part(part_table(ids), opts)
    return [f"part-r000-{ids[0]:09d}.{SUFFIX[fmt]}" for ids in groups]


def record(out: Path, part: str) -> Path:
    return out / COMMITS / f"{part}.json"


def snapshot(root: Path, out: Path) -> dict[str, bytes]:
    """Every file under `root` outside `out` (links not followed), with its bytes."""
    return {
        str(p): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and not p.is_relative_to(out)
    }
