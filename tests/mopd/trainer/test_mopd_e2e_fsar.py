"""FSAR end to end on CPU: ``python -m claas_verl.main_mopd --config-name mopd/fsar_shared scale=tiny
mopd.signal.window=16`` shortened to two
domains (1 logic step, then 3 math steps + 1 logic replay step taught by M_1, then 2 recovery steps), with r = 2.

The one-rank run uses the Qwen3 variant of the tiny bundle: per-head q/k norms inside FSDP2-resharded layers, the
model family whose first replay step crashed on the GPU. The Qwen2 bundle's balanced step is checked against the
unsharded step in ``test_mopd_balanced_step.py`` and end to end by the two-rank run (``-m slow``) and the other
e2e tests; one trainer job per bundle here would add two minutes to the default suite for the same assertions.

The replay step runs the balanced multi-pass update (docs/math.md §B.6/B.7) inside the actor worker: teacher alignment
targets, SATS / VR / hidden passes, eq. (10) then eq. (9) before clipping. Its logged parts are in the configured
norm ratio r; new-domain and recovery steps stay single token passes; every step is one AdamW update.
"""

from __future__ import annotations

import json
import math

import pytest

SHORT = ("mopd.order=[logic,math]", "mopd.domains.logic.num_blocks=1", "mopd.recovery.enabled=true",
         "mopd.recovery.blocks_per_domain=1", "mopd.setting=S2", "mopd.eval.enabled=false",
         "mopd.signal.ratio=2.0")
PLAN_KEYS = ("stage", "kind", "domain", "block", "teacher")


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fsar_replay_step_logs_balanced_gradients_at_the_configured_ratio(mopd_run, mopd_plan, fast, ranks,
                                                                          request):
    """``ranks=1`` on the Qwen3 bundle; ``ranks=2``: two training ranks (gloo, FSDP2 over two logical GPUs) on the
    default Qwen2 bundle, the norms all-reduced over both."""
    bundle = []
    if ranks == 1:
        qwen3_dir = request.getfixturevalue("tiny_qwen3_dir")
        config = json.loads((qwen3_dir / "student" / "config.json").read_text())
        assert config["model_type"] == "qwen3" and config["head_dim"] >= 32
        bundle = [f"tiny_dir={qwen3_dir}"]
    run_dir, log = mopd_run("mopd/fsar_shared scale=tiny mopd.signal.window=16", "fsar", *fast, *SHORT,
                            f"trainer.n_gpus_per_node={ranks}",
                            *bundle)
    steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines() if x.strip()]
    assert [{k: s[k] for k in PLAN_KEYS} for s in steps] == mopd_plan(
        "mopd/fsar_shared scale=tiny mopd.signal.window=16", *SHORT[:5])
    replay = [s for s in steps if s["kind"] == "replay"]
    assert [(s["stage"], s["domain"], s["teacher"]) for s in replay] == [(2, "logic", "student:1")]
    m = replay[0]["metrics"]
    assert m["actor/mopd/balance_fallback"] == 0
    # eq. (9): ‖token part‖ / ‖aux part‖ = r; c = ‖g_tok‖ / ‖g_aux‖
    assert m["actor/mopd/tok_part_norm"] / m["actor/mopd/aux_part_norm"] == pytest.approx(2.0, rel=1e-5)
    assert m["actor/mopd/balance_scale"] == pytest.approx(
        m["actor/mopd/tok_grad_norm"] / m["actor/mopd/aux_grad_norm"], rel=1e-5)
    for t in ("sats", "vr", "hidden"):
        assert m[f"actor/mopd/{t}_loss"] > 0 and math.isfinite(m[f"actor/mopd/{t}_loss"])
    for t in ("sats", "vr", "hid", "tok"):
        assert m[f"actor/mopd/{t}_grad_norm"] > 0
    for c in ("cos_tok_aux", "cos_sats_vr", "cos_u_hid"):
        assert -1.0 <= m[f"actor/mopd/{c}"] <= 1.0
    assert m["mopd/regions_per_response"] >= 1 and m["mopd/window_tokens"] > 0
    # r = 2 >= 1: the update keeps the full token gradient, so clipping (at 1000) sees ‖g‖ >= ‖g_tok‖·√(1+1/4+cos)
    assert m["actor/grad_norm"] == pytest.approx(m["actor/mopd/balanced_grad_norm"], rel=1e-4)
    # new-domain and recovery steps are single token passes (docs/math.md §B.6, B.8): no balancing metrics at all
    assert {s["kind"] for s in steps} == {"new", "replay", "recovery"}
    for s in steps:
        if s["kind"] != "replay":
            assert not [k for k in s["metrics"] if k.startswith("actor/mopd/") and k != "actor/mopd/tok_loss"], s
            assert "mopd/regions_per_response" not in s["metrics"]
    # exactly one AdamW update per plan step, for every step kind (fresh state at each stage start)
    counts, first = [], {}
    for i, s in enumerate(steps):
        first.setdefault(s["stage"], i)
        counts.append((s["kind"], s["metrics"]["mopd/optimizer_steps_in_stage"], i - first[s["stage"]] + 1))
    assert all(got == want for _, got, want in counts), counts
    assert all(s["metrics"]["mopd/update_skipped"] == 0 for s in steps)
    print(f"FSAR replay step: c = {m['actor/mopd/balance_scale']:.4g}, ‖g_tok‖ = {m['actor/mopd/tok_grad_norm']:.4g}, "
          f"cos(tok, aux) = {m['actor/mopd/cos_tok_aux']:.3f}, cos(SATS, VR) = {m['actor/mopd/cos_sats_vr']:.3f}, "
          f"cos(u, hid) = {m['actor/mopd/cos_u_hid']:.3f}")
