"""Hidden-state (B.3), SATS (B.4) and VR (B.5) loss values, micro-batch means (B.7), tiny-model signals."""

import math

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from claas_verl.align import (
    PooledRows,
    alignment_losses,
    alignment_signals,
    default_sats_layers,
    hidden_alignment_loss,
    naive_pooled_attention_rows,
    pooled_rows_loss,
    step_regions,
    to_bf16_target,
    value_relation_rows,
)


def test_hidden_term_hand_values():
    # D=2, one response with 2 window positions (the third position is outside the window).
    # layer A: pos0 s=[1,0], t=[0,1] -> ‖ĥs−ĥt‖² = 2 -> /D = 1;  pos1 s=[3,4], t=[6,8] -> same direction -> 0
    # layer B: identical states -> 0.   ℓ = (1/2)·[(1+0)/2 + 0] = 0.25
    win = torch.tensor([[True, True, False]])
    s_a = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]]], requires_grad=True)
    t_a = torch.tensor([[[0.0, 1.0], [6.0, 8.0], [1.0, 0.0]]])
    s_b = to_bf16_target(torch.randn(1, 3, 2)).float()  # bf16-exact, so the teacher copy rounds to itself
    val = hidden_alignment_loss([s_a, s_b], [t_a, s_b.clone()], win)
    assert math.isclose(val.loss.item(), 0.25, abs_tol=1e-7)
    assert val.count == 2 and val.n_responses == 1
    val.loss.backward()
    assert s_a.grad[0, 2].abs().sum() == 0  # positions outside the window get no gradient


def test_hidden_term_is_two_one_minus_cos_over_d():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    t = to_bf16_target(t).float()  # bf16-exact teacher so the identity holds without rounding noise
    win = torch.rand(2, 5, generator=gen) < 0.7
    cos = torch.nn.functional.cosine_similarity(s, t, dim=-1)
    expect = (2 * (1 - cos) / 16)[win].mean()
    assert torch.allclose(hidden_alignment_loss([s], [t], win).loss, expect, atol=1e-6)


def test_hidden_teacher_rounded_to_bf16_before_normalising():
    # teacher [1, 1+2^-10] rounds to [1, 1] in bf16 (8-bit mantissa), so a student [1, 1] has loss exactly 0
    s = torch.tensor([[[1.0, 1.0]]])
    t = torch.tensor([[[1.0, 1.0 + 2**-10]]])
    assert hidden_alignment_loss([s], [t], torch.tensor([[True]])).loss.item() == 0.0


def test_hidden_empty_window_is_zero_not_nan():
    s = torch.randn(2, 3, 4, requires_grad=True)
    val = hidden_alignment_loss([s], [torch.randn(2, 3, 4)], torch.zeros(2, 3, dtype=torch.bool))
    val.loss.backward()
    assert val.loss.item() == 0.0 and val.count == 0 and torch.equal(s.grad, torch.zeros_like(s))


def _rows(vals):
    return torch.tensor(vals, dtype=torch.float32)


def test_sats_loss_hand_values():
    # B=2, H=2, R_max=2, Tk=3. Response 0 has 2 regions, response 1 has none (its rows are ignored).
    # resp0 region0: head0 diff [1,0,0] -> 1, head1 diff [0,2,0] -> 4, mean over heads 2.5
    # resp0 region1: head0 diff [0,0,1] -> 1, head1 0             ->    mean over heads 0.5
    # per response (2.5+0.5)/2 = 1.5; |Y| = 1 -> 1.5 per layer; two equal layers -> 3.0
    zero = [[0.0] * 3] * 2
    teacher = _rows([[zero, zero], [zero, zero]])
    student = _rows([
        [[[1, 0, 0], [0, 0, 1]], [[0, 2, 0], [0, 0, 0]]],
        [[[5, 5, 5], [5, 5, 5]], [[5, 5, 5], [5, 5, 5]]],  # garbage on a response without regions
    ])
    num = torch.tensor([2, 0])
    one = pooled_rows_loss([student], [teacher], num)
    assert math.isclose(one.loss.item(), 1.5, abs_tol=1e-6) and one.count == 1 and one.n_responses == 2
    two = pooled_rows_loss([PooledRows(student, 0)] * 2, [PooledRows(teacher, 0)] * 2, num)
    assert math.isclose(two.loss.item(), 3.0, abs_tol=1e-6)


def test_sats_microbatch_weighting_equals_full_batch():
    # B.7: L = Σ_mb (n_resp(mb)/n_total)·ℓ(mb); with every response holding a region this equals ℓ(batch)
    gen = torch.Generator().manual_seed(3)
    s, t = torch.rand(4, 3, 5, 7, generator=gen), torch.rand(4, 3, 5, 7, generator=gen)
    num = torch.tensor([5, 2, 1, 3])
    full = pooled_rows_loss([s], [t], num).loss
    parts = [pooled_rows_loss([s[i : i + 2]], [t[i : i + 2]], num[i : i + 2]) for i in (0, 2)]
    weighted = sum(p.loss * p.n_responses / 4 for p in parts)
    assert torch.allclose(full, weighted, atol=1e-6)


def test_value_relation_rows_per_kv_head():
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(2, 2, 9, 8, generator=gen)
    am = torch.ones(2, 9, dtype=torch.long)
    am[0, :3] = 0
    reg = step_regions(torch.tensor([[0, 1, 0, 0], [1, 0, 0, 1]]), torch.ones(2, 4, dtype=torch.long), {1}).pad_left(5)
    rows = value_relation_rows(v, am, reg.region_ids, reg.num_regions, chunk_size=2)
    ref = naive_pooled_attention_rows(v, v, am, reg.region_ids, reg.num_regions)
    assert rows.rows.shape[1] == 2  # G KV heads, not H
    assert (rows.rows - ref.rows).abs().max() <= 2e-6


def _tiny(seed):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg)


def _rollout(sep_ids=(5, 9)):
    gen = torch.Generator().manual_seed(0)
    prompt, resp = 6, 10
    ids = torch.randint(0, 128, (3, prompt + resp), generator=gen)
    am = torch.ones_like(ids)
    am[0, :2] = 0
    am[1, -4:] = 0
    ids[:, prompt + 3] = 5  # a separator in every response
    reg = step_regions(ids[:, prompt:], am[:, prompt:], set(sep_ids), window=6).pad_left(prompt)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    return ids, am, pos, reg


def test_signals_on_tiny_model_student_vs_teacher():
    student, teacher = _tiny(0), _tiny(1)
    ids, am, pos, reg = _rollout()
    with torch.no_grad():
        _, t_sig = alignment_signals(teacher, ids, am, reg, position_ids=pos, chunk_size=4)
    targets = t_sig.as_targets()
    assert targets.sats[3].rows.dtype == torch.bfloat16 and targets.hidden[0].dtype == torch.bfloat16
    out, s_sig = alignment_signals(student, ids, am, reg, position_ids=pos, chunk_size=4)
    assert sorted(s_sig.sats) == default_sats_layers(4) == [0, 1, 2, 3]
    assert sorted(s_sig.hidden) == [0, 1, 2, 3]
    losses = alignment_losses(s_sig, targets, reg)
    assert set(losses) == {"sats", "vr", "hidden"}
    for name, val in losses.items():
        assert torch.isfinite(val.loss) and val.loss.item() > 0, name
    assert losses["hidden"].count == int(reg.window_mask.sum())
    assert losses["sats"].count == 3
    # one forward serves every term and the token logits
    total = sum(v.loss for v in losses.values()) + out.logits.float().mean()
    total.backward()
    assert student.model.layers[2].self_attn.k_proj.weight.grad.abs().sum() > 0
    # same model as its own teacher: only bf16 rounding of the targets remains
    with torch.no_grad():
        _, same = alignment_signals(student, ids, am, reg, position_ids=pos)
        self_losses = alignment_losses(same, same.as_targets(), reg)
    assert all(v.loss.item() < 1e-4 for v in self_losses.values())


def test_no_region_anywhere_gives_zero_loss_and_grad():
    student = _tiny(0)
    ids, am, pos, reg = _rollout(sep_ids=())
    # drop_trailing with no separator in any window: zero regions in the micro-batch
    reg0 = step_regions(ids[:, 6:], am[:, 6:], set(), window=6, drop_trailing=True).pad_left(6)
    assert reg0.num_regions.tolist() == [0, 0, 0]
    with torch.no_grad():
        _, t_sig = alignment_signals(_tiny(1), ids, am, reg0, position_ids=pos, terms=("sats", "vr"))
    _, s_sig = alignment_signals(student, ids, am, reg0, position_ids=pos, terms=("sats", "vr"))
    losses = alignment_losses(s_sig, t_sig.as_targets(), reg0)
    (losses["sats"].loss + losses["vr"].loss).backward()
    assert losses["sats"].loss.item() == 0.0 and losses["vr"].loss.item() == 0.0
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and g.abs().sum() == 0 for g in grads)
