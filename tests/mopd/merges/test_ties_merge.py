"""TIES and uniform-average merges (docs/math.md §B.10): hand-computed vectors, equivalences, the CLI on tiny HF
models."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from claas_verl.mopd.merges import (
    SafetensorsDir,
    disjoint_mean,
    elect_sign,
    iter_ties_stagewise,
    save_like,
    ties_merge,
    ties_merge_flat,
    ties_stagewise,
    trim,
    trim_k,
    trim_thresholds,
    uniform_average,
)
from claas_verl.mopd.merges.cli import main as merges_main

T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


# ----------------------------------------------------------------------------------------- trim / elect / mean

def test_trim_keeps_ties_at_the_threshold():
    tau = T(0.1, -0.5, 0.5, 0.2, 0.0, 0.3, -0.05, 0.5, 0.5, 0.05)
    # d = 10, k = 10 − ⌊0.2·10⌋ = 8; sorted |τ| = 0 .05 .05 .1 .2 .3 .5 .5 .5 .5 → 8th smallest = 0.5
    assert trim_k(10, 0.2) == 8
    kept = trim(tau, 0.2)
    # every |τ| = 0.5 is kept: 4 entries, more than ⌊0.2d⌋ + 1 = 3, because of the ties
    assert torch.equal(kept, T(0, -0.5, 0.5, 0, 0, 0, 0, 0.5, 0.5, 0))


def test_trim_mostly_zero_keeps_everything():
    # d = 20 with 17 zeros (> 80%): k = 20 − 4 = 16 → the 16th smallest |τ| is 0 → thr = 0 keeps all, even 1e-6
    tau = torch.zeros(20)
    tau[[3, 7, 11]] = T(1e-6, 0.3, -0.2)
    assert torch.equal(trim(tau, 0.2), tau)
    for method in ("streaming", "flat"):
        assert trim_thresholds(lambda: [tau[None, :8], tau[None, 8:]], 0.2, method).item() == 0.0


def test_elect_with_majority_fallback_and_disjoint_mean():
    trimmed = torch.stack([T(1, -2, 3, 0, 2), T(-1, 1, -1, 0, 1)])
    # Σ = [0, −1, 2, 0, 3] → σ = [0, −1, 1, 0, 1]; Σ_entries σ = 1 → majority +1 fills both zeros
    sign = elect_sign(trimmed)
    assert torch.equal(sign, T(1, -1, 1, 1, 1))
    # agreeing entries: [1] → 1; [−2] → −2; [3] → 3 (−1 dropped); none → 0/max(0,1) = 0; [2, 1] → 1.5
    assert torch.equal(disjoint_mean(trimmed, sign), T(1, -2, 3, 0, 1.5))


def test_sign_zero_after_majority_keeps_negative_entries():
    trimmed = torch.stack([T(1, -2), T(-1, 2)])
    sign = elect_sign(trimmed)  # Σ = [0, 0] → σ = [0, 0]; majority sign(0) = 0 → stays 0
    assert torch.equal(sign, T(0, 0))
    assert torch.equal(disjoint_mean(trimmed, sign), T(-1, -2))  # reference code: the negative entries survive


def test_ties_merge_by_hand():
    base = {"a": T(1, 1, 1), "step": torch.tensor(7), "b": T(0, 0)}
    m1 = {"a": T(2, -1, 4), "step": torch.tensor(100), "b": T(0, 2)}  # τ1 = [1, −2, 3 | 0, 2]
    m2 = {"a": T(0, 2, 0), "step": torch.tensor(200), "b": T(0, 1)}  # τ2 = [−1, 1, −1 | 0, 1]
    # density 1: k = max(5 − 5, 1) = 1 → thr = min |τ| = 0 → nothing trimmed; merged = [1, −2, 3 | 0, 1.5] (above)
    out = ties_merge(base, [m1, m2], density=1.0)
    assert torch.equal(out["a"], T(2, -1, 4)) and torch.equal(out["b"], T(0, 1.5))
    assert out["step"].item() == 7 and list(out) == ["a", "step", "b"]  # non-float from the base, base key order
    assert torch.equal(ties_merge(base, [m1, m2], density=1.0, lam=0.5)["a"], T(1.5, 0, 2.5))
    # density 0.2: k = 5 − 1 = 4. |τ1| sorted 0 1 2 2 3 → thr 2 → τ̂1 = [0, −2, 3 | 0, 2] (tie 2 kept)
    #   |τ2| sorted 0 1 1 1 1 → thr 1 → τ̂2 = [−1, 1, −1 | 0, 1]
    #   Σ = [−1, −1, 2 | 0, 3] → σ = [−1, −1, 1 | 0, 1]; Σσ = 0 → majority 0, σ_3 stays 0 (no negative entry there)
    #   merged = [−1, −2, 3 | 0, (2 + 1)/2] → θ = base + merged
    out = ties_merge(base, [m1, m2], density=0.2)
    assert torch.equal(out["a"], T(0, -1, 4)) and torch.equal(out["b"], T(0, 1.5))
    stats = {}
    ties_merge(base, [m1, m2], density=0.2, stats=stats)
    assert stats["d"] == 5 and stats["thresholds"] == [2.0, 1.0] and stats["majority_sign"] == 0.0
    assert stats["kept_fraction"] == [0.6, 0.8]


def _random_state(seed, base=None, zero_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (17, 8), "w1": (8, 8), "norm": (8,), "w2": (8, 8)}
    out = {}
    for k, s in shapes.items():
        x = torch.randn(s, generator=g)
        if base is not None:
            delta = torch.randn(s, generator=g) * 0.1
            delta = torch.where(torch.rand(s, generator=g) < zero_frac, torch.zeros(s), delta)
            delta = torch.round(delta * 64) / 64  # coarse grid: many exact ties in |τ|
            x = base[k].float() + delta
        out[k] = x
    out["pos_ids"] = torch.arange(5) + seed
    return out


@pytest.mark.parametrize("zero_frac", [0.0, 0.5, 0.9])
def test_per_parameter_equals_flat(zero_frac):
    base = _random_state(0)
    base["w2"] = base["w2"].to(torch.bfloat16)  # mixed dtypes: τ is taken in fp32, output keeps each base dtype
    models = [_random_state(s, base, zero_frac) for s in (1, 2, 3)]
    models[2]["w2"] = models[2]["w2"].to(torch.bfloat16)
    ref = ties_merge_flat(base, models)
    for method in ("streaming", "flat"):
        got = ties_merge(base, models, threshold_method=method)
        assert list(got) == list(base)
        for k in base:
            assert got[k].dtype == base[k].dtype and torch.equal(got[k], ref[k]), (method, k)


def test_streaming_threshold_is_exact():
    g = torch.Generator().manual_seed(5)
    # magnitudes spanning many exponents, denormals, zeros and exact ties
    x = torch.cat([torch.randn(3, 1000, generator=g) * 10.0 ** torch.randint(-40, 5, (3, 1000), generator=g),
                   torch.zeros(3, 50), torch.full((3, 30), 0.125), torch.full((3, 5), 1e-44)], dim=1)
    cols = [x[:, i:i + 97] for i in range(0, x.shape[1], 97)]
    for density in (0.2, 0.01, 0.5, 0.97, 1.0, 0.0):
        k = trim_k(x.shape[1], density)
        want = x.abs().kthvalue(k, dim=1).values
        assert torch.equal(trim_thresholds(lambda: iter(cols), density, "streaming"), want)
        assert torch.equal(trim_thresholds(lambda: iter(cols), density, "flat"), want)


# ----------------------------------------------------------------------------------------- stagewise / average

def test_stagewise_reads_the_bf16_copy():
    base = _random_state(0)
    experts = [_random_state(s, base) for s in (1, 2, 3)]
    stages = list(iter_ties_stagewise(base, experts))
    assert [k for k, _ in stages] == [1, 2, 3]
    m1, m2, m3 = (m for _, m in stages)
    assert torch.equal(m1["w1"], experts[0]["w1"].to(torch.bfloat16)) and m1["pos_ids"] is base["pos_ids"]
    # m_k = bf16(θ_0 + TIES_fp32({m_{k−1} − θ_0, E_k − θ_0})), with m_{k−1} the stored bf16 tensors
    m2_fp32 = ties_merge(base, [m1, experts[1]])
    assert all(torch.equal(m2[k], m2_fp32[k].to(torch.bfloat16)) for k in ("emb", "w1", "norm", "w2"))
    assert all(m2[k].dtype == torch.bfloat16 for k in ("emb", "w1", "norm", "w2"))
    m3_want = ties_merge(base, [m2, experts[2]], out_dtype=torch.bfloat16)
    assert all(torch.equal(m3[k], m3_want[k]) for k in base)
    # reading an fp32 m_2 instead of the bf16 copy gives another stage 3: the rounding matters
    m3_fp32_path = ties_merge(base, [m2_fp32, experts[2]], out_dtype=torch.bfloat16)
    assert any(not torch.equal(m3[k], m3_fp32_path[k]) for k in ("emb", "w1", "w2"))
    final = ties_stagewise(base, experts)
    assert all(torch.equal(final[k], m3[k]) for k in base)


def test_uniform_average():
    a = {"w": T(1, 2), "n": torch.tensor(3)}
    b = {"w": T(3, 6), "n": torch.tensor(9)}
    c = {"w": T(2, 1), "n": torch.tensor(0)}
    out = uniform_average([a, b, c])
    assert torch.equal(out["w"], T(2, 3)) and out["n"].item() == 3  # (1+3+2)/3, (2+6+1)/3; non-float from models[0]
    assert uniform_average([a, b], out_dtype=torch.bfloat16)["w"].dtype == torch.bfloat16


def test_bad_inputs():
    base = {"w": T(1, 2)}
    with pytest.raises(ValueError, match="other parameter names"):
        ties_merge(base, [{"v": T(1, 2)}])
    with pytest.raises(ValueError, match="shape"):
        ties_merge(base, [{"w": T(1, 2, 3)}])
    with pytest.raises(ValueError, match="non-finite"):
        ties_merge(base, [{"w": T(1, float("nan"))}])
    with pytest.raises(ValueError, match="density"):
        ties_merge(base, [{"w": T(1, 3)}], density=1.5)
    with pytest.raises(ValueError, match="non-empty list"):
        ties_merge(base, [])


# ----------------------------------------------------------------------------------------- HF directories and CLI

@pytest.fixture(scope="module")
def tiny():
    from claas_verl.tiny import ensure_tiny

    return ensure_tiny()


def _files(d):
    return sorted(p.name for p in d.iterdir())


def test_cli_ties_of_experts(tiny, tmp_path):
    out = tmp_path / "ties"
    experts = [tiny.experts[d] for d in ("logic", "math", "code")]
    assert merges_main(["ties", "--base", str(tiny.student), "--models", *map(str, experts), "--out", str(out)]) == 0
    want = ties_merge(SafetensorsDir(tiny.student), [SafetensorsDir(e) for e in experts])
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _files(out) == _files(tiny.student)  # config, generation config, tokenizer files, chat template copied
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(out)
    emb = model.get_input_embeddings().weight
    assert torch.equal(emb.detach(), want["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(out).chat_template is not None
    with pytest.raises(ValueError, match="not empty"):
        merges_main(["ties", "--base", str(tiny.student), "--models", str(experts[0]), "--out", str(out)])


def test_cli_stagewise_and_average(tiny, tmp_path):
    experts = [tiny.experts[d] for d in ("logic", "math", "code")]
    out = tmp_path / "stagewise"
    merges_main(["ties", "--stagewise", "--base", str(tiny.student), "--models", *map(str, experts),
                 "--out", str(out)])
    want = ties_stagewise(SafetensorsDir(tiny.student), [SafetensorsDir(e) for e in experts])
    got = load_file(str(out / "model.safetensors"))
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    avg_out = tmp_path / "avg"
    merges_main(["average", "--models", *map(str, experts), "--out", str(avg_out)])
    want = uniform_average([SafetensorsDir(e) for e in experts])
    got = load_file(str(avg_out / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sharded_layout_is_kept(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)
    dirs = []
    for seed in range(3):
        torch.manual_seed(seed)
        d = tmp_path / f"m{seed}"
        Qwen2ForCausalLM(cfg).save_pretrained(d, max_shard_size="20KB")
        dirs.append(d)
    shards = sorted(p.name for p in dirs[0].glob("*.safetensors"))
    assert len(shards) > 1
    out = tmp_path / "merged"
    # through `python -m` to check the entry point
    proc = subprocess.run([sys.executable, "-m", "claas_verl.mopd.merges", "ties", "--base", str(dirs[0]), "--models",
                           str(dirs[1]), str(dirs[2]), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((dirs[0] / "model.safetensors.index.json").read_text())["weight_map"]
    want = ties_merge(SafetensorsDir(dirs[0]), [SafetensorsDir(dirs[1]), SafetensorsDir(dirs[2])])
    got = SafetensorsDir(out)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    Qwen2ForCausalLM.from_pretrained(out)  # loads


def test_save_like_rejects_unknown_or_missing(tmp_path, tiny):
    src = SafetensorsDir(tiny.student)
    with pytest.raises(ValueError, match="no tensor for"):
        save_like(tiny.student, [(k, src[k]) for k in list(src)[:-1]], tmp_path / "a")
    with pytest.raises(ValueError, match="not in the template"):
        save_like(tiny.student, [("nope", torch.zeros(1))], tmp_path / "b")
