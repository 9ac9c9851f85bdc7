"""The Ray Data stages of a job, in the order rows meet them: read.py (parquet, JSONL, CSV; and
openai_batch.py, OpenAI batch files), tokenize.py, plan.py (the one global barrier: metadata to
the driver, build_plan, unit payloads; or the job in windows, windows.py planning the next while
the engines run), generate.py (the engine actors: a replica's units in plan
order, or from work_queue.py's prefix-affine stealing queues; isolate.py keeps one row's
exception to that row). They import operators/' shared modules and results/, never faces/.
"""
