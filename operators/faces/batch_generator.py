"""Generator: the lighter mode, a callable class for `ds.map_batches`.

    ds.map_batches(prefixflow.Generator, fn_constructor_kwargs={"config": config},
                   batch_size=512, concurrency=2, batch_format="pyarrow")

Each actor plans within each batch (prefix tree, groups, order over the batch's rows only) and
runs it through its own engine. No global barrier: it streams like any map_batches, but
sharing across batches is only caught by the engine's prefix cache. Use `build_processor` for
the global plan. Outputs come back in the batch's row order. Its tokenizer and engine take
their settings from the ProcessorConfig (tokenize_options(), engine_config), as every other
face does: chat_template and chat_template_kwargs included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from prefixflow.operators.columns import ERROR, IMAGE_AT
from prefixflow.operators.config import ProcessorConfig
from prefixflow.operators.results.outputs import INTERNAL, error_records, input_name
from prefixflow.operators.results.progress import LiveBar
from prefixflow.operators.stages.generate import ReplicaRunner
from prefixflow.operators.stages.plan import adapter_seeds, plan_tokens
from prefixflow.operators.stages.tokenize import TOKENS, Tokenize
from prefixflow.pipeline import HashedPrompts, RaggedTokens, build_plan


class Generator:
    """map_batches callable class. Give a ProcessorConfig, or its fields as keywords."""

    def __init__(self, config: ProcessorConfig | None = None, **fields: Any):
        self.config = config if config is not None else ProcessorConfig(**fields)
        cfg = self.config
        # The config's tokenize options, chat_template and chat_template_kwargs included, as
        # every other face takes them.
        self.tokenize = Tokenize(cfg.tokenize_options())
        # A live bar of this actor's rows on the driver (operators/results/progress.py); more may come.
        self.progress = LiveBar("prefixflow Generator", close_when_done=False)
        self.runner = ReplicaRunner(cfg, report=self.progress.report)  # cfg's backend, loaded once here
        self.runner.load()
        self.batches = 0

    def __call__(self, batch: Any) -> pa.Table:
        table = _to_table(batch)
        if ERROR not in table.column_names:
            table = table.append_column(ERROR, pa.nulls(table.num_rows, pa.string()))
        table = self.tokenize(table)
        errors = table.column(ERROR).is_valid().to_numpy(zero_copy_only=False)
        good = np.flatnonzero(~errors)
        self.progress.add_rows(table.num_rows, int(errors.sum()))
        pieces = []
        if len(good):
            plan = build_plan(self._prompts(table.take(pa.array(good))), row_ids=good, order=self.config.order)
            groups = plan.groups(0)
            order = np.concatenate([g.row_ids for g in groups]).astype(np.int64)
            rows = table.drop_columns([TOKENS]).take(pa.array(order))
            pieces += list(self.runner.run(0, groups, rows, order))
            self.progress.run_done(0)
        bad = np.flatnonzero(errors)
        if len(bad):
            rows = table.drop_columns([TOKENS]).take(pa.array(bad))
            pieces.append(error_records(rows, bad.tolist(), rows.column(ERROR).to_pylist(), 0, self.config.task))
        self.batches += 1
        out = pa.concat_tables(pieces, promote_options="permissive")
        # Back to the batch's row order; row_id is the position within this batch.
        out = out.take(pc_sort_indices(out.column("row_id")))
        return _own_names_back(out.drop_columns([*INTERNAL, "replica", "row_id"]), table.column_names)

    def _prompts(self, good: pa.Table) -> RaggedTokens | HashedPrompts:
        """The good rows' prompts for the plan: their tokens, or with LoRA adapters or images
        their block hashes keyed by adapter and image (operators/stages/plan.adapter_seeds,
        plan_tokens)."""
        seeds = adapter_seeds(good)
        if seeds is None and IMAGE_AT not in good.column_names:
            return RaggedTokens.from_sequences(good.column(TOKENS))
        return HashedPrompts.from_tokens(
            good.column(TOKENS), self.config.engine_config.block_size, seeds=seeds, keyed=plan_tokens(good)
        )


def _own_names_back(out: pa.Table, names: list[str]) -> pa.Table:
    """with_outputs kept the batch's own `replica` / `row_id` columns as input_<name>; ours are
    dropped here, so theirs get their names back."""
    for name in ("replica", "row_id"):
        kept = input_name(name, names)
        if name in names and kept in out.column_names:
            out = out.rename_columns([name if c == kept else c for c in out.column_names])
    return out


def pc_sort_indices(column: pa.ChunkedArray) -> pa.Array:
    return pa.array(np.argsort(column.to_numpy(), kind="stable"))


def _to_table(batch: Any) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):  # numpy format
        return pa.table(
            {k: pa.array(list(v) if getattr(v, "dtype", None) == np.dtype(object) else v) for k, v in batch.items()}
        )
    import pandas as pd

    if isinstance(batch, pd.DataFrame):
        return pa.Table.from_pandas(batch, preserve_index=False)
    raise TypeError(f"Generator got a batch of type {type(batch).__name__}: use batch_format='pyarrow'")
