"""Reasoning-step regions (docs/math.md §B.4) on hand examples with a tiny fake tokenizer."""

import torch

from claas_verl.align import StepRegions, response_window_mask, separator_token_ids, step_regions


class FakeTokenizer:
    # id: text. Separators by the math reference's rule: 2 ("\n\n"), 3 (contains "\n\n"), 6 (</think>).
    # id 5 is a single "\n": two of them in a row are NOT a separator (single-token rule).
    TEXTS = ["a", "b", "\n\n", "x\n\ny", "c", "\n", "</think>", "d", "<unk>", " "]
    unk_token_id = 8

    def __init__(self, has_think=True):
        self.has_think = has_think
        self.decode_calls = 0

    def __len__(self):
        return len(self.TEXTS)

    def decode(self, ids):
        self.decode_calls += 1
        return "".join(self.TEXTS[i] for i in ids)

    def convert_tokens_to_ids(self, tok):
        if tok == "</think>" and not self.has_think:
            return self.unk_token_id
        return self.TEXTS.index(tok) if tok in self.TEXTS else self.unk_token_id


def _regions(ids, mask=None, window=2000, drop_trailing=False):
    ids = torch.tensor([ids])
    mask = torch.ones_like(ids) if mask is None else torch.tensor([mask])
    return step_regions(ids, mask, {2, 3, 6}, window=window, drop_trailing=drop_trailing)


def test_separator_ids_and_cache():
    tok = FakeTokenizer()
    assert separator_token_ids(tok) == {2, 3, 6}
    calls = tok.decode_calls
    assert separator_token_ids(tok) == {2, 3, 6}
    assert tok.decode_calls == calls  # cached: the vocabulary is decoded once per tokenizer
    # a tokenizer without </think> (maps to unk) only has the blank-line tokens
    assert separator_token_ids(FakeTokenizer(has_think=False)) == {2, 3}


def test_partition_full_window():
    # seps at positions 2 and 5 -> regions [0,0,0 | 1,1,1 | 2,2]; the last ends without separator
    r = _regions([0, 1, 2, 4, 7, 3, 0, 1])
    assert r.region_ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]
    assert r.num_regions.tolist() == [3]
    assert r.spans() == [[(0, 2), (3, 5), (6, 7)]]
    # drop the trailing fragment (flag): region 2 goes
    r = _regions([0, 1, 2, 4, 7, 3, 0, 1], drop_trailing=True)
    assert r.region_ids.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    assert r.num_regions.tolist() == [2]


def test_window_shorter_than_response_cuts_first_step():
    # W=4 keeps positions 4..7 (tokens 7,3,0,1): the cut step [7,3] is region 0, [0,1] region 1
    r = _regions([0, 1, 2, 4, 7, 3, 0, 1], window=4)
    assert r.region_ids.tolist() == [[-1, -1, -1, -1, 0, 0, 1, 1]]
    assert r.window_mask.tolist() == [[False] * 4 + [True] * 4]
    assert r.num_regions.tolist() == [2]


def test_think_end_separator_and_right_padding():
    # tokens a, \n\n, </think>, then padding whose id is a separator (must be ignored)
    for drop in (False, True):
        r = _regions([0, 2, 6, 2, 2], mask=[1, 1, 1, 0, 0], drop_trailing=drop)
        # last valid token is a separator, so nothing is dropped with the flag either
        assert r.region_ids.tolist() == [[0, 0, 1, -1, -1]]
        assert r.num_regions.tolist() == [2]


def test_one_region_and_empty():
    r = _regions([0, 1, 4])  # no separator: one region over the whole window
    assert r.region_ids.tolist() == [[0, 0, 0]] and r.num_regions.tolist() == [1]
    r = _regions([0, 1, 4], drop_trailing=True)  # the only region is a trailing fragment
    assert r.region_ids.tolist() == [[-1, -1, -1]] and r.num_regions.tolist() == [0]
    r = _regions([0, 1, 4], mask=[0, 0, 0])
    assert r.region_ids.tolist() == [[-1, -1, -1]] and r.num_regions.tolist() == [0]
    # two single "\n" tokens do not make a blank line under the single-token rule
    r = _regions([0, 5, 5, 1])
    assert r.num_regions.tolist() == [1]


def test_batch_rows_independent_and_pad_left():
    ids = torch.tensor([[0, 2, 1, 0], [3, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    r = step_regions(ids, mask, {2, 3, 6})
    assert r.region_ids.tolist() == [[0, 0, 1, 1], [0, 1, 2, -1]]
    assert r.num_regions.tolist() == [2, 3]
    p = r.pad_left(2)
    assert isinstance(p, StepRegions)
    assert p.region_ids.tolist() == [[-1, -1, 0, 0, 1, 1], [-1, -1, 0, 1, 2, -1]]
    assert p.window_mask.tolist()[1] == [False, False, True, True, True, False]
    assert p.num_regions.tolist() == [2, 3]


def test_window_mask_skips_padding():
    m = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    assert response_window_mask(m, 2).long().tolist() == [[0, 0, 1, 1, 0], [1, 0, 0, 0, 0]]
