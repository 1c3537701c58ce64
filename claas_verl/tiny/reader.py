"""The reader bundle: the tiny student fine-tuned to read a rule in its context (benchmarks/plans/claas_feedback.md).

``python -m claas_verl.tiny reader OUT_DIR --seed 0 --sft-steps N`` builds, offline on CPU, from the current tiny
student (:mod:`claas_verl.tiny.build`, bundle version 3) a student meant to follow a rule of the rule-following
environment more often when its context states it (how much it does is measured into its manifest; the shipped one
of seed 0 does not meet the plan's gates: benchmarks/LOG.md, 2026-12-06). The fine-tune (full weights, one thread,
seeded, AdamW at a constant :data:`SFT` learning rate on the reply tokens) trains on conversations of the
rule-following generator at build-time scenario seeds ``1000 + i`` (disjoint from the stream's seed 0), one rule per
scenario, every family of ``ALL_FAMILIES`` equally, in three equal thirds:

1. the rule in the system prompt → a reply of the pre-fine-tune student that passes it (:data:`SAMPLES_PER_TURN`
   replies sampled at τ = 1, 12 tokens; the first passing one; none: no example);
2. the system prompt without the rule line → an unfiltered reply of the pre-fine-tune student (the base rate);
3. the rule in the system prompt and the verifier's feedback on a failed reply, as SDPO's re-prompt of the last user
   turn (even scenarios) or as ICL's feedback block (odd ones) → a passing reply.

A conversation's later turns see the reply it continued with (the passing one where there is one). Each third is
cycled up to the largest third's size, so every batch draws from the three equally in expectation. That is version
1's design (plan step 1, the shipped bundle); version 2 (:data:`DESIGNS`, plan step 1c) builds from the stream's two
rule families only and gives a rule-only example a passing target with probability 0.4 only, else the turn's first
sampled reply, so that the feedback context is trained toward more compliance than the rule-only one (and it
alternates the two feedback forms by pairs of scenarios, so that each rule has both).

Layout of OUT_DIR: ``student/`` (the HF model and tokenizer; the CLaaS tiny recipes read ``$CLAAS_TINY_DIR/student``,
so ``CLAAS_TINY_DIR=OUT_DIR`` runs them on it) and ``manifest.json`` (version, seed, the fine-tune, the data counts,
and ``instruction_reading``: ``{family: {condition: [pass rate, n]}}`` of :mod:`claas_verl.tiny.reader_measure`, for
the fine-tuned student and, as ``pre_sft_<condition>``, the student it started from, with the plan's gates).

:func:`ensure_reader` unpacks the repository's shipped copy (``benchmarks/bundles/reader_v1_seed0.tar.gz``) and
checks its fingerprint, like :func:`claas_verl.tiny.gym.ensure_gym`; ``build=True`` builds instead.
:func:`measure_grid` runs the plan's choice of N: one fine-tune to the largest N of :data:`STEPS_GRID`, measured at
every N of it (a build with ``--sft-steps N`` is bit for bit that run's state at step N: constant learning rate,
the same seeded batch order).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from claas_verl.tiny.reader_measure import STREAM_FAMILIES
from claas_verl.tiny.shipped import BundlePaths, bundle_dir, put_in_place, shipped

READER_VERSION = "1"  # the shipped bundle's design (below); a design is a version of the bundle
DEFAULT_READER_DIR = "/tmp/claas_verl_tiny_reader"
ENV_READER_DIR = "CLAAS_TINY_READER_DIR"
READER_MANIFEST_MARKER = "instruction_reading"  # a key only the reader bundle's manifest has
LOG = "[tiny reader]"
BUILD_SEED_BASE = 1000  # build-time scenario seeds 1000 + i; the stream's generator seed is 0
SAMPLES_PER_TURN = 8
# Constant learning rate, gradient norm clipped at 1. Batches of 8: ICL's feedback block makes a third of the examples
# ~900 tokens long, and a batch of 32 took 8.8 s a step on the shared 2-core machine.
SFT = dict(lr=1e-3, batch_size=8)
STEPS_GRID = (50, 100, 200, 400, 800)  # the plan's N; the smallest that meets every gate is chosen
# The N the plan's rule chose (measure_grid, seed 0, 2026-12-06): none of STEPS_GRID met every gate (benchmarks/LOG.md).
READER_SFT_STEPS: int | None = None
# The N of the shipped bundle: the rule's, else the grid's largest (plan amendment of 2026-12-06), for engineering use
SHIPPED_SFT_STEPS = READER_SFT_STEPS if READER_SFT_STEPS is not None else max(STEPS_GRID)


@dataclass(frozen=True)
class ReaderDesign:
    """What one version of the bundle is built from (plan steps 1 and 1c).

    ``families``: the rule families of the build scenarios (None: every family of ``ALL_FAMILIES``), scenario ``i``
    of family ``families[i % len(families)]``; ``scenarios_per_family``; ``rule_pass_share``: the chance (a seeded
    draw per example) that a rule-only example's target is a passing reply, else the turn's first sampled reply,
    passing or not. 1.0 trains the rule-only and the feedback contexts toward the same answer; below 1 the rule-only
    context is trained toward partial compliance (≈ share + (1 − share)·s⁰) and the feedback context toward full.
    ``form_stride``: scenario ``i``'s feedback examples take ICL's form iff ``i // form_stride`` is odd, else SDPO's
    re-prompt (with two families alternating, stride 2 gives each family both forms; stride 1 would give one family
    only SDPO's and the other only ICL's)."""

    families: tuple[str, ...] | None
    scenarios_per_family: int
    rule_pass_share: float
    form_stride: int


DESIGNS = {
    "1": ReaderDesign(None, 32, 1.0, 1),  # step 1: every family, every rule-only target passes
    "2": ReaderDesign(STREAM_FAMILIES, 144, 0.4, 2),  # step 1c: the stream's rules only
}


def design_of(version: str) -> ReaderDesign:
    if version not in DESIGNS:
        raise ValueError(f"reader version {version!r} is not one of {sorted(DESIGNS)} (claas_verl/tiny/reader.py "
                         "DESIGNS)")
    return DESIGNS[version]


def default_reader_dir(version: str = READER_VERSION) -> Path:
    """``$CLAAS_TINY_READER_DIR`` or /tmp/claas_verl_tiny_reader for the shipped version; other versions beside it
    with a ``_v<version>`` suffix, so that two versions never replace each other."""
    root = bundle_dir(ENV_READER_DIR, DEFAULT_READER_DIR)
    return root if version == READER_VERSION else root.with_name(f"{root.name}_v{version}")


@dataclass(frozen=True)
class ReaderPaths(BundlePaths):
    """The reader bundle's files (its manifest and student; nothing more)."""


def is_current(out_dir: str | os.PathLike, seed: int = 0, version: str = READER_VERSION) -> bool:
    try:
        m = json.loads(ReaderPaths(Path(out_dir)).manifest.read_text())
    except (OSError, ValueError):
        return False
    return (m.get("version") == version and m.get("seed") == seed and READER_MANIFEST_MARKER in m
            and (ReaderPaths(Path(out_dir)).student / "model.safetensors").is_file())


def ensure_reader(directory: str | os.PathLike | None = None, seed: int = 0, build: bool = False,
                  sft_steps: int | None = None, version: str = READER_VERSION) -> ReaderPaths:
    """The reader bundle at ``directory`` (default :func:`default_reader_dir` of ``version``),
    made first if missing or stale: unpacked from the repository's shipped copy of ``version`` and seed, its
    fingerprint checked (a mismatch raises ``ValueError``), or built with ``build=True`` (``sft_steps`` steps,
    default :data:`SHIPPED_SFT_STEPS`). File-locked, made in a temporary sibling renamed into place; a directory
    there that is not a reader bundle is refused (``FileExistsError``), never replaced."""
    from filelock import FileLock

    from claas_verl.tiny.build import refuse_foreign_dir

    design_of(version)
    out_dir = Path(directory if directory is not None else default_reader_dir(version)).resolve()
    if is_current(out_dir, seed, version) and not build:
        return ReaderPaths(out_dir)
    refuse_foreign_dir(out_dir, "reader", READER_MANIFEST_MARKER, ENV_READER_DIR)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock", timeout=3600):
        if is_current(out_dir, seed, version) and not build:
            return ReaderPaths(out_dir)
        refuse_foreign_dir(out_dir, "reader", READER_MANIFEST_MARKER, ENV_READER_DIR)
        ship = None if build else shipped("reader", version, seed)
        if ship is None and not build:
            raise FileNotFoundError(
                f"no shipped reader bundle reader_v{version}_seed{seed} in benchmarks/bundles/ (or "
                "$CLAAS_VERL_BUNDLES): build it with "
                f"`python -m claas_verl.tiny reader DIR --build --version {version} --sft-steps N`")
        steps = sft_steps if sft_steps is not None else SHIPPED_SFT_STEPS
        put_in_place(out_dir, ship, lambda tmp: build_reader(tmp, seed, steps, version=version), LOG)
    return ReaderPaths(out_dir)


# ----------------------------------------------------------------------------- build data


def build_scenarios(seed: int, per_family: int | None = None, version: str = READER_VERSION):
    """One-rule scenarios at generator seeds ``1000 + i`` (``i``: scenario number; its family
    ``families[i % len(families)]`` of the version's design), with the stream's number of turns. ``seed`` (the
    build seed) shifts nothing: the scenarios are the plan's, the build seed changes the sampling and the
    fine-tune."""
    from claas_verl.claas.envs.rule_following import ALL_FAMILIES, make_rule_scenario
    from claas_verl.tiny.reader_measure import TURNS

    del seed
    design = design_of(version)
    families = design.families or ALL_FAMILIES
    n = (design.scenarios_per_family if per_family is None else per_family) * len(families)
    return [make_rule_scenario(BUILD_SEED_BASE + i, 0, TURNS, 1, 1, (families[i % len(families)],))
            for i in range(n)]


def sft_thirds(sampler, scenarios, seed: int, rule_pass_share: float = 1.0, form_stride: int = 1
               ) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The three thirds of the module docstring as ``(prompt ids, reply ids)`` examples; a rule-only example's
    target is the passing reply with probability ``rule_pass_share``, else the turn's first sampled reply; the
    feedback examples of scenario ``i`` take ICL's form iff ``i // form_stride`` is odd (:class:`ReaderDesign`)."""
    import random

    from claas_verl.tiny.reader_measure import TURNS, feedback_contexts, grade, rollouts, without_rule
    from claas_verl.utils.prompt_rows import stable_seed

    count = lambda s: len(sampler.tok.encode(s, add_special_tokens=False))  # noqa: E731
    # Its own generator: at share 1.0 no draw is made and design 1's examples are those it was built from
    share_rng = random.Random(stable_seed("claas_reader.rule_target", seed))
    thirds: dict[str, list] = {"rule": [], "no_rule": [], "feedback": []}
    for conv in rollouts(sampler, scenarios, [without_rule(sc) for sc in scenarios], 1, ("build", seed, "base")):
        thirds["no_rule"] += [(sampler.prompt_ids(s.messages), s.ids) for s in conv]
    history: list[list[str]] = [[] for _ in scenarios]
    for t in range(TURNS):
        msgs = [sc.messages(t, history[i]) for i, sc in enumerate(scenarios)]
        drawn = sampler.sample(msgs, ("build", seed, "rule", t), k=SAMPLES_PER_TURN)
        for i, (sc, replies) in enumerate(zip(scenarios, drawn)):
            steps = [grade(sc, t, msgs[i], r) for r in replies]
            good = next((s for s in steps if s.passed), None)
            bad = next((s for s in steps if not s.passed), None)
            history[i].append((good or steps[0]).text)
            if rule_pass_share < 1.0 and share_rng.random() >= rule_pass_share:
                thirds["rule"].append((sampler.prompt_ids(msgs[i]), steps[0].ids))
            elif good is not None:
                thirds["rule"].append((sampler.prompt_ids(msgs[i]), good.ids))
            if good is None:
                continue
            if bad is not None:
                teacher, icl = feedback_contexts(bad, (bad.text, bad.feedback), count)
                thirds["feedback"].append((sampler.prompt_ids(icl if (i // form_stride) % 2 else teacher), good.ids))
    return thirds


def sft_mix(thirds: dict[str, list]) -> list:
    """Every third cycled up to the largest one's size (``claas_verl.tiny.gym.joint_mix``)."""
    from claas_verl.tiny.gym import joint_mix

    return joint_mix(thirds, tuple(thirds))


def sft_checkpoints(model, examples: Sequence, steps: Sequence[int], seed: int, pad_token_id: int,
                    on_checkpoint: Callable[[int], None], stop: Callable[[int], bool] = lambda n: False) -> None:
    """AdamW on the reply tokens at a constant ``SFT["lr"]`` (gradient norm clipped at 1), batches of
    ``SFT["batch_size"]`` drawn by a generator seeded with ``seed``; ``on_checkpoint(n)`` after step n for every
    n of ``steps`` (the model in eval mode then), so one run gives the state of each shorter run; training ends
    there when ``stop(n)``."""
    import torch

    from claas_verl.tiny.sft import sft_step
    from claas_verl.utils.progress import Progress

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT["lr"], weight_decay=0.0)
    progress = Progress(f"{LOG} SFT", max(steps), "steps")
    for step in range(1, max(steps) + 1):
        model.train()
        loss = sft_step(model, opt, examples, gen, SFT["batch_size"], pad_token_id)
        progress.update(loss=float(loss.detach()))
        if step in steps:
            model.eval()
            on_checkpoint(step)
            if stop(step):
                break
    model.eval()


class _OneThread:
    """One thread and deterministic kernels: the weights and the sampled replies are then reproducible."""

    def __enter__(self):
        import torch

        self.threads, self.det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.det)


def _start(seed: int, workdir: Path, version: str = READER_VERSION):
    """(pre-SFT model, tokenizer, tiny bundle fingerprint, the thirds of ``version``'s design) for a build or a
    grid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from claas_verl.tiny.build import make_tiny
    from claas_verl.tiny.fingerprint import bundle_fingerprint
    from claas_verl.tiny.reader_measure import Sampler
    from claas_verl.utils.hf_quiet import hf_progress_bars_off

    # The tiny bundle of this seed built afresh beside the output ($CLAAS_TINY_DIR may point at a reader bundle)
    tiny = make_tiny(workdir / "tiny", seed=seed)
    with hf_progress_bars_off():
        tok = AutoTokenizer.from_pretrained(tiny.student)
        model = AutoModelForCausalLM.from_pretrained(tiny.student).eval()
    print(f"{LOG} sampling the fine-tune's conversations from the tiny student", file=sys.stderr, flush=True)
    design = design_of(version)
    thirds = sft_thirds(Sampler(model, tok), build_scenarios(seed, version=version), seed, design.rule_pass_share,
                        design.form_stride)
    return model, tok, bundle_fingerprint(tiny.root), thirds


def _data_counts(thirds: dict[str, list]) -> dict[str, int]:
    return {name: len(rows) for name, rows in thirds.items()}


def write_manifest(paths: ReaderPaths, seed: int, sft_steps: int, base_fp: str, thirds: dict[str, list] | None,
                   after: dict | None, before: dict | None, seconds: float, examples: dict | None = None,
                   version: str = READER_VERSION) -> dict:
    """The bundle's manifest (module docstring); ``after`` / ``before``: :func:`reader_measure.measure` of the
    fine-tuned and of the pre-SFT student on the same families (None: not measured)."""
    from claas_verl.tiny.reader_measure import merged_table, reading_gates

    design = design_of(version)
    n_scenarios = len(build_scenarios(seed, version=version))
    manifest = {
        "version": version,
        "seed": seed,
        "base": {"kind": "tiny", "version": "3", "fingerprint": base_fp},
        "sft": {**SFT, "steps": sft_steps, "constant_lr": True, "clip_grad_norm": 1.0,
                "scenario_seeds": f"{BUILD_SEED_BASE}..{BUILD_SEED_BASE + n_scenarios - 1}",
                "scenarios_per_family": design.scenarios_per_family, "samples_per_turn": SAMPLES_PER_TURN,
                # version 1's manifest (and so its recorded fingerprint) predates these two keys
                **({"families": list(design.families or ()), "rule_pass_share": design.rule_pass_share,
                    "form_stride": design.form_stride} if version != "1" else {}),
                "examples": examples if examples is not None else _data_counts(thirds)},
        "paths": {"student": "student"},
        "build_seconds": round(seconds, 1),
        READER_MANIFEST_MARKER: None,
    }
    if after is not None and before is not None:
        table = merged_table(after, before)
        manifest[READER_MANIFEST_MARKER] = table
        manifest["instruction_reading_protocol"] = protocol()
        manifest["max_prompt_tokens"] = {f: after[f]["max_prompt_tokens"] for f in after}
        manifest["gates"] = reading_gates(table)
    paths.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def build_reader(root: Path, seed: int, sft_steps: int, measure: bool = True, version: str = READER_VERSION) -> None:
    """The bundle into the new folder ``root``: the fine-tuned student and the manifest (module docstring)."""
    import tempfile

    from claas_verl.tiny.gym import stop_and_pad_ids
    from claas_verl.tiny.model import save_model
    from claas_verl.tiny.reader_measure import measure as measure_model
    from claas_verl.utils.prompt_rows import stable_seed

    if sft_steps < 1:
        raise ValueError(f"sft_steps must be >= 1, got {sft_steps}")
    t0 = time.time()
    root.mkdir(parents=True)
    paths = ReaderPaths(root)
    print(f"{LOG} building the reader bundle v{version} into {root} (seed {seed}, {sft_steps} SFT steps)",
          file=sys.stderr, flush=True)
    with _OneThread(), tempfile.TemporaryDirectory(prefix="claas_reader_") as work:
        model, tok, base_fp, thirds = _start(seed, Path(work), version)
        before = measure_model(model, tok, ("measure", seed), label=f"{LOG} pre-SFT") if measure else None
        sft_checkpoints(model, sft_mix(thirds), [sft_steps], stable_seed("claas_reader.sft", seed),
                        stop_and_pad_ids(tok)[1], lambda n: None)
        save_model(model, tok, paths.student)
        after = measure_model(model, tok, ("measure", seed), label=f"{LOG} reader") if measure else None
    write_manifest(paths, seed, sft_steps, base_fp, thirds, after, before, time.time() - t0, version=version)


def complete_manifest(paths: ReaderPaths, pre=None, tok=None) -> dict:
    """Measure the families the bundle's manifest does not have yet (the grid measures only the gated ones) on its
    student and on the pre-SFT student ``pre`` (default: the tiny student of the manifest's seed, built afresh),
    and rewrite the manifest with every family, in ``ALL_FAMILIES`` order."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from claas_verl.claas.envs.rule_following import ALL_FAMILIES
    from claas_verl.tiny.reader_measure import CONDITIONS, measure

    m = json.loads(paths.manifest.read_text())
    table = m[READER_MANIFEST_MARKER]
    rest = tuple(f for f in ALL_FAMILIES if f not in table)
    key = ("measure", m["seed"])
    with _OneThread(), tempfile.TemporaryDirectory(prefix="claas_reader_") as work:
        if pre is None:
            from claas_verl.tiny.build import make_tiny
            from claas_verl.tiny.fingerprint import bundle_fingerprint

            tiny = make_tiny(Path(work) / "tiny", seed=m["seed"])
            if bundle_fingerprint(tiny.root) != m["base"]["fingerprint"]:
                raise ValueError(f"{paths.manifest}: base.fingerprint is {m['base']['fingerprint']} but the tiny "
                                 f"student built here is {bundle_fingerprint(tiny.root)}: this machine builds another "
                                 "pre-SFT student, so its pass rates would not be the bundle's; rebuild with --build")
            tok = AutoTokenizer.from_pretrained(tiny.student)
            pre = AutoModelForCausalLM.from_pretrained(tiny.student).eval()
        student = AutoModelForCausalLM.from_pretrained(paths.student).eval()
        after = measure(student, tok, key, rest, label=f"{LOG} N={m['sft']['steps']}, other families")
        before = measure(pre, tok, key, rest, label=f"{LOG} pre-SFT, other families")
    known_after = {f: {**{c: row[c] for c in CONDITIONS}, "max_prompt_tokens": m["max_prompt_tokens"][f]}
                   for f, row in table.items()}
    known_before = {f: {c: row[f"pre_sft_{c}"] for c in CONDITIONS} for f, row in table.items()}
    after, before = {**known_after, **after}, {**known_before, **before}
    order = [f for f in ALL_FAMILIES if f in after]
    sft = m["sft"]
    return write_manifest(paths, m["seed"], sft["steps"], m["base"]["fingerprint"], None,
                          {f: after[f] for f in order}, {f: before[f] for f in order}, m["build_seconds"],
                          examples=sft["examples"], version=m["version"])


def protocol() -> dict:
    from claas_verl.tiny import reader_measure as rm

    return {"held_out_seed": rm.HELD_OUT_SEED, "scenarios_per_family": rm.HELD_OUT_SCENARIOS, "turns": rm.TURNS,
            "rollouts": rm.ROLLOUTS, "max_new_tokens": rm.MAX_NEW_TOKENS, "temperature": 1.0,
            "extra_draws_for_feedback": rm.EXTRA_DRAWS, "icl_token_budget": rm.ICL_TOKEN_BUDGET,
            "gated_families": list(rm.STREAM_FAMILIES), "interval": "two-proportion Wald 95%"}


def measure_grid(out_dir: Path, seed: int = 0, grid: Sequence[int] = STEPS_GRID, stop_at_choice: bool = True,
                 version: str = READER_VERSION) -> dict:
    """The plan's choice of N: one fine-tune to ``max(grid)``; at every N of ``grid`` the bundle of that N in
    ``out_dir/N<n>`` (its manifest measured on the gated families ``STREAM_FAMILIES``, all the rule reads); the
    smallest N that meets every gate is ``chosen`` (None if none), and the shipped one (``shipped``: the chosen N,
    else the largest, plan amendment of 2026-12-06) has its manifest completed with every family
    (:func:`complete_manifest`). The tables, gates and choice go to ``out_dir/grid.json``. ``stop_at_choice``: the
    fine-tune stops at the first N that meets every gate (a larger N cannot change the rule's choice)."""
    import copy
    import tempfile

    from claas_verl.tiny.gym import stop_and_pad_ids
    from claas_verl.tiny.model import save_model
    from claas_verl.tiny.reader_measure import STREAM_FAMILIES, gates_pass, measure, merged_table, reading_gates
    from claas_verl.utils.prompt_rows import stable_seed

    t0 = time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_json = out_dir / "grid.json"
    result: dict = {"seed": seed, "version": version, "design": vars(design_of(version)), "grid": list(grid),
                    "sft": SFT, "protocol": protocol(), "tables": {}, "gates": {}, "chosen": None}
    key = ("measure", seed)
    with _OneThread(), tempfile.TemporaryDirectory(prefix="claas_reader_") as work:
        model, tok, base_fp, thirds = _start(seed, Path(work), version)
        pre = copy.deepcopy(model)
        result["base_fingerprint"], result["examples"] = base_fp, _data_counts(thirds)
        before = measure(pre, tok, key, STREAM_FAMILIES, label=f"{LOG} pre-SFT")

        def at(n: int) -> None:
            after = measure(model, tok, key, STREAM_FAMILIES, label=f"{LOG} N={n}")
            paths = ReaderPaths(out_dir / f"N{n}")
            shutil.rmtree(paths.root, ignore_errors=True)
            save_model(model, tok, paths.student)
            write_manifest(paths, seed, n, base_fp, thirds, after, before, time.time() - t0, version=version)
            table = merged_table(after, before)
            result["tables"][str(n)], result["gates"][str(n)] = table, reading_gates(table)
            out_json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")  # each N as soon as measured

        sft_checkpoints(model, sft_mix(thirds), sorted(grid), stable_seed("claas_reader.sft", seed),
                        stop_and_pad_ids(tok)[1], at,
                        stop=lambda n: stop_at_choice and gates_pass(result["gates"][str(n)]))
        chosen = next((n for n in sorted(grid) if str(n) in result["gates"] and gates_pass(result["gates"][str(n)])),
                      None)
        # the shipped N: the rule's choice, else the longest fine-tune (plan amendment of 2026-12-06)
        result["chosen"], result["shipped"] = chosen, chosen if chosen is not None else max(result["tables"], key=int)
        out_json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        complete_manifest(ReaderPaths(out_dir / f"N{result['shipped']}"), pre, tok)
    result["seconds"] = round(time.time() - t0, 1)
    out_json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result
