"""Which rows an output part holds, read from the part's own bytes.

A resume proves each commit record's row ids by this (operators/results/commit.py), so that a record
edited to claim rows its part does not hold never has those rows counted as done: the record's
sha256 covers the part's bytes, not what the record says about them.

- parquet and jsonl parts carry each row's `row_id` column (operators/results/outputs.py);
- an OpenAI batch line has only OpenAI's fields, so its `id` is made from its custom_id and its
  row id (`request_digest`): a record's row ids are proved line by line against it.
"""

from __future__ import annotations

import hashlib
import io
import json


def request_digest(custom_id: object, row_id: int) -> str:
    """The hex digest an OpenAI output line's ids are cut from (operators/results/openai_output.py):
    the same request and row always get the same ids, and a line proves its row."""
    return hashlib.sha256(f"{custom_id}:{row_id}".encode()).hexdigest()


def batch_line_id(digest: str) -> str:
    """An OpenAI output line's `id`, from its request_digest."""
    return f"batch_req_{digest[:24]}"


def holds_rows(part: str, data: bytes, row_ids: list[int]) -> bool:
    """Whether the part named `part`, whose bytes are `data`, holds exactly the rows `row_ids`,
    in that order (the writer's record lists them in the part's row order)."""
    try:
        if part.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(io.BytesIO(data), columns=["row_id"]).column(0).to_pylist() == row_ids
        lines = [json.loads(line) for line in data.splitlines() if line.strip()]
    except (ValueError, KeyError, OSError):  # not parquet, no row_id column, not JSON lines
        return False
    if len(lines) != len(row_ids) or not all(isinstance(line, dict) for line in lines):
        return False
    if all("row_id" in line for line in lines):
        return [line["row_id"] for line in lines] == row_ids
    return all(_openai_line_is(line, row) for line, row in zip(lines, row_ids))


def _openai_line_is(line: dict, row_id: int) -> bool:
    """An OpenAI output line is row `row_id`'s when its id is that row's request_digest."""
    return line.get("id") == batch_line_id(request_digest(line.get("custom_id"), row_id))
