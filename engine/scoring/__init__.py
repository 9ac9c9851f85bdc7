"""The score task (PrefillOnly): one probability per allowed answer, no decoding.

scorer.py (Scorer) runs forward.py's hybrid prefilling one request at a time in srjf.py's order,
keeping group prefixes in cache.py; choices.py turns choices into token ids and logits into a
ScoreOutput; options.py (ScoreOptions) is torch-free. The vLLM backend scores through
choices.py and options.py too.
"""
