"""scale_bench's workload is what issue 28 asks for (the bench itself needs a quiet machine and a
multi-node cluster: it is run by hand, `python -m prefixflow.bench.scale_bench`)."""

from __future__ import annotations

from collections import Counter

from prefixflow.bench.scale_bench import make_rows, prompt_token_floors, zipf_counts


def test_question_counts_follow_a_zipf_law():
    counts = zipf_counts(2048, 614, 1.3)
    assert sum(counts) == 2048 and counts == sorted(counts, reverse=True)
    assert counts[0] >= 300 and counts[2] >= 100            # a few documents asked hundreds of times
    assert sum(1 <= c <= 5 for c in counts) > len(counts) / 2  # most asked one to five


def test_rows_have_long_documents_varied_outputs_and_arrive_shuffled(tiny_model):
    from prefixflow.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    rows = make_rows(tok, 300, seed=1)
    assert [r["id"] for r in rows] == list(range(300))
    per_doc = Counter(r["doc_id"] for r in rows)
    docs = {r["doc_id"]: r["document"] for r in rows}
    assert all(200 <= len(tok.encode(d)) <= 2400 for d in docs.values())
    assert {r["max_tokens"] for r in rows} <= set(range(8, 129)) and len({r["max_tokens"] for r in rows}) > 50
    assert max(per_doc.values()) >= 60
    hot = per_doc.most_common(1)[0][0]  # shuffled: the hot document's rows do not come together
    positions = [i for i, r in enumerate(rows) if r["doc_id"] == hot]
    assert positions[-1] - positions[0] > len(positions)
    assert len({(r["doc_id"], r["question"]) for r in rows}) == 300


def test_prompt_token_floors_count_distinct_tokens_and_whole_blocks():
    # Sorted: abcd, abcd (shares 3 of its 4: one whole block of 2), abce (the same), z.
    prompts = [[1, 2, 3, 5], [9], [1, 2, 3, 4], [1, 2, 3, 4]]
    assert prompt_token_floors(prompts, block=2) == {
        "prompt_tokens": 13, "distinct_prompt_tokens": 6, "whole_block_floor": 4 + 2 + 2 + 1}
    # One token per block: every shared token is reused, but a prompt met whole recomputes its last.
    assert prompt_token_floors(prompts, block=1)["whole_block_floor"] == 4 + 1 + 1 + 1
