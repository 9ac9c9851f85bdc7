"""The bookkeeping columns every stage shares, from the read stage on.

  _pf_source  where a row came from ("file.jsonl:17"), for error messages;
  _pf_error   None for a good row, else why the row cannot run (it becomes an error record);
  _pf_adapter the LoRA adapter a row runs with (None: the base model), from its `model` column,
              set by the tokenize stage in a job with adapters (prefixflow/lora.py) and read by
              the plan (its hashes' keys) and the engine actors (each row's SamplingParams);
  _pf_images, _pf_image_at, _pf_image_keys
              a row's images (encoded bytes), the positions of their placeholder tokens in its
              prompt and their keys (prefixflow/images.py), set by the tokenize stage in a job that
              takes images, read by the plan (keys in place of the placeholders) and the engine
              actors (the bytes, in each row's SamplingParams).

Every bookkeeping column starts with `_pf_` (RESERVED), so input columns may not. The read
stage adds these two (operators/stages/read.py), the OpenAI batch reader fills them from each request
line (openai_batch.py), and every later stage reads them; they live here, below all of those,
so that none of them imports another stage for a column's name.
"""

from __future__ import annotations

SOURCE, ERROR, ADAPTER = "_pf_source", "_pf_error", "_pf_adapter"
IMAGES, IMAGE_AT, IMAGE_KEYS = "_pf_images", "_pf_image_at", "_pf_image_keys"
RESERVED = "_pf_"  # the prefix of every bookkeeping column; input columns may not use it
