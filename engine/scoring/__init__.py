"""The prefill-only tasks (PrefillOnly): score (one probability per allowed answer) and embed
(one vector per row), no decoding.

scorer.py (Scorer) runs forward.py's hybrid prefilling one request at a time in srjf.py's order,
keeping group prefixes in cache.py; choices.py turns choices into token ids and logits into a
ScoreOutput; pooling.py says how hidden states become an EmbedOutput (torch-free);
options.py (ScoreOptions) is torch-free. The vLLM backend scores through choices.py and
options.py and embeds with pooling.py's settings too.
"""
