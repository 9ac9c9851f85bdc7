"""Job: a job spec read once (JobSpec.to_job), the typed record every step of a run takes.

The run (jobs/run.py), its report (jobs/report.py) and the CLI's `plan --out` work from this
record, never from the spec's sections: each setting is read from the spec in one function,
JobSpec.to_job (its ProcessorConfig in JobSpec.to_config). Only preflight reads the spec itself,
as its problems are named by the spec's field paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.results.table_commit import TableOutput
from prefixflow.operators.results.write import WriteOptions
from prefixflow.operators.stages.read import ReadOptions
from prefixflow.storage import StorageOptions


@dataclass(frozen=True)
class Job:
    name: str
    config: ProcessorConfig  # every setting of the stages and engines
    read: ReadOptions  # the input: paths, format, storage, limit
    write: WriteOptions  # the output: path, format, storage (its lock's token set by the run)
    overwrite: bool  # delete a finished or foreign output first
    resume: bool  # keep the committed parts of an interrupted run
    error_file: bool  # format openai: the failed requests' lines in errors.jsonl
    identity_key: str  # what must not change between a run and its resume (JSON)
    engine_fields: dict[str, Any]  # the engine section as given (OpenAI's system_fingerprint)
    table_out: TableOutput | None = None  # table output: the rows go there at the end

    @property
    def storage(self) -> StorageOptions:
        """The storage settings every reader and writer of this job uses."""
        return self.write.storage
