"""The Ray Data side of a job, in rooms: the shared modules here (config.py, template.py,
columns.py, row_sampling.py) < results/ (output rows, parts, commits, progress) < stages/
(read, tokenize, plan, generate) < faces/ (the Python API, map_batches, ray.data.llm's API).
A room imports the shared modules and the rooms below it (tests/cpu/test_layers.py).
"""
