"""What a job gives back: the output rows (outputs.py, and score.py's columns for the score
task), their parts written and committed exactly once (write.py, commit.py, with part_rows.py
and bookkeeping.py, the strict readers of an output folder), OpenAI batch output files
(openai_output.py) and live progress (progress.py). They import only operators/' shared modules.
"""
