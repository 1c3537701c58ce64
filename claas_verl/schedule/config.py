"""Typed, validated MOPD schedule configuration (the ``mopd`` section of a recipe).

Built from a plain mapping; every invalid value raises ``ValueError`` naming the full key (``mopd.replay.m`` ...)
and what is allowed. Only the keys that decide *which block of which domain is trained when, under which teacher*
live here (docs/math.md §B.8); the loss/signal/optimizer keys of the same section (``mopd.signal.*``,
``mopd.train.*``) belong to the trainer and are not read. Reading a composed recipe (an OmegaConf node) and counting
the rows of prompt files is the MOPD layer's job (``claas_verl/mopd/recipe_schedule.py``): this module opens no file
and imports nothing but the standard library.

Block counts: ``mopd.domains.<d>.num_blocks`` if given, otherwise the rows of the prompt file (counted by the
caller's ``count_rows``) divided by ``mopd.block_size`` and rounded DOWN: a partial last block is dropped, because
every step of the MOPD paper trains exactly one full block (B.1: 32 prompts per block, and the micro-batch weights
of B.7 assume it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from claas_verl.schedule.budgets import REPLAY_CYCLES
from claas_verl.utils.schema import knob

BUDGETS = ("seq", "shared", "fixed")
RECOVERY_TEACHERS = ("snapshots", "experts")
REPLAY_TEACHERS = ("previous", "experts")
SETTINGS = ("S1", "S2", "S3")
MISSING = "???"
# count_rows(prompts, key) -> the rows of the prompt file ``prompts`` names; ``key`` names the field in its errors
RowCounter = Callable[[str, str], int]


@dataclass(frozen=True)
class DomainSpec:
    name: str
    num_blocks: int
    prompts: str | None  # None when the recipe leaves it required (``???``) and gives num_blocks
    expert: str | None


@dataclass(frozen=True)
class ReplayConfig:
    m: int = knob(3, "shared budget: one replay step after every m new-domain steps")
    b: int = knob(7, "fixed share: replay steps per earlier domain and stage")
    fixed_from_stage: int = knob(3, "stages 2..f-1 use the shared budget (the MOPD paper reuses the shared stage 2)")
    teachers: str = knob("previous", "who teaches a replay step of stage k: previous (M_{k-1}, the MOPD paper, "
                         "docs/math.md §B.1) | experts (the replayed domain's own E_j, a deviation; setting S2)")
    cycle: str = knob("forward", "order of a stage's replay steps over the earlier domains: forward (d_1, d_2, ..., "
                      "the MOPD paper) | reversed (the same steps backwards, so d_1 is replayed last; a deviation)")


@dataclass(frozen=True)
class RecoveryConfig:
    enabled: bool = knob(False, "add the recovery stage after the last domain (docs/math.md §B.8)")
    teachers: str = knob("snapshots", "teachers of the recovery stage: snapshots (M_1..M_K) | experts (E_1..E_K)")
    blocks_per_domain: int = knob(7, "recovery blocks per domain")


@dataclass(frozen=True)
class JointConfig:
    enabled: bool = knob(False, "joint training: every domain's blocks in one stage")
    passes: int = knob(1, "passes over the domains")
    order: tuple[str, ...] | None = knob(None, "domain order of the joint stage (null: mopd.order)")


@dataclass(frozen=True)
class ScheduleConfig:
    order: tuple[str, ...] = knob(help="the domains in the order they are learned")
    domains: dict[str, DomainSpec] = knob(help="exactly the domains of order")
    budget: str = knob("seq", "replay budget: seq (none) | shared | fixed (docs/math.md §B.8)")
    block_size: int = knob(32, "prompts per block; counts a domain's blocks when it gives no num_blocks")
    replay: ReplayConfig = knob(ReplayConfig(), "replay steps")
    recovery: RecoveryConfig = knob(RecoveryConfig(), "the recovery stage")
    joint: JointConfig = knob(JointConfig(), "joint training")
    segment_size: int | None = knob(None, "S3 only: stages per segment", key="segments.size")
    setting: str = knob("S1", "S1 snapshot-free | S2 snapshots and experts kept to the end | S3 segments (MOPD "
                        "paper §3.1)")

    @property
    def num_blocks(self) -> dict[str, int]:
        return {d: self.domains[d].num_blocks for d in self.order}

    @property
    def joint_order(self) -> tuple[str, ...]:
        return self.joint.order if self.joint.order is not None else self.order

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, mopd: Mapping[str, Any], count_rows: RowCounter | None = None) -> ScheduleConfig:
        """Build from a plain mapping shaped like the ``mopd`` section; see the module docstring.

        ``count_rows(prompts, key)`` counts the rows of a domain's prompt file when the domain gives no
        ``num_blocks`` (the MOPD layer passes one that reads ``.parquet`` and ``.jsonl``); without it such a domain
        is an error that says so.
        """
        if not isinstance(mopd, Mapping):
            raise ValueError(f"mopd: expected a mapping, got {type(mopd).__name__}")
        block_size = _int(mopd, "block_size", "mopd.block_size", default=ScheduleConfig.block_size, minimum=1)
        order = _name_list(mopd.get("order", MISSING), "mopd.order")
        raw_domains = mopd.get("domains")
        if not isinstance(raw_domains, Mapping) or not raw_domains:
            raise ValueError("mopd.domains: required mapping `<name>: {prompts, expert, num_blocks}`")
        for d in order:
            if d not in raw_domains:
                raise ValueError(
                    f"mopd.order: unknown domain {d!r}; mopd.domains defines {sorted(raw_domains)}"
                )
        domains = {d: _domain(d, raw_domains[d], block_size, count_rows) for d in order}

        budget = _choice(mopd, "budget", "mopd.budget", BUDGETS, default=ScheduleConfig.budget)
        rep = _section(mopd, "replay")
        replay = ReplayConfig(
            m=_int(rep, "m", "mopd.replay.m", default=ReplayConfig.m, minimum=1),
            b=_int(rep, "b", "mopd.replay.b", default=ReplayConfig.b, minimum=0),
            fixed_from_stage=_int(rep, "fixed_from_stage", "mopd.replay.fixed_from_stage",
                                  default=ReplayConfig.fixed_from_stage, minimum=2),
            teachers=_choice(rep, "teachers", "mopd.replay.teachers", REPLAY_TEACHERS, default=ReplayConfig.teachers),
            cycle=_choice(rep, "cycle", "mopd.replay.cycle", REPLAY_CYCLES, default=ReplayConfig.cycle),
        )
        rec = _section(mopd, "recovery")
        recovery = RecoveryConfig(
            enabled=_bool(rec, "enabled", "mopd.recovery.enabled", default=RecoveryConfig.enabled),
            teachers=_choice(rec, "teachers", "mopd.recovery.teachers", RECOVERY_TEACHERS,
                             default=RecoveryConfig.teachers),
            blocks_per_domain=_int(rec, "blocks_per_domain", "mopd.recovery.blocks_per_domain",
                                   default=RecoveryConfig.blocks_per_domain, minimum=1),
        )
        if recovery.enabled:
            for d in order:
                if recovery.blocks_per_domain > domains[d].num_blocks:
                    raise ValueError(
                        f"mopd.recovery.blocks_per_domain={recovery.blocks_per_domain} is larger than the "
                        f"{domains[d].num_blocks} blocks of domain {d!r}; lower it to at most "
                        f"{min(s.num_blocks for s in domains.values())}"
                    )
        jnt = _section(mopd, "joint")
        joint_order = jnt.get("order")
        if joint_order is not None:
            joint_order = _name_list(joint_order, "mopd.joint.order")
            if sorted(joint_order) != sorted(order):
                raise ValueError(
                    f"mopd.joint.order={list(joint_order)} must be a permutation of mopd.order={list(order)} "
                    "(or null for the sequence order)"
                )
        joint = JointConfig(
            enabled=_bool(jnt, "enabled", "mopd.joint.enabled", default=JointConfig.enabled),
            passes=_int(jnt, "passes", "mopd.joint.passes", default=JointConfig.passes, minimum=1),
            order=joint_order,
        )
        seg = _section(mopd, "segments")
        segment_size = None
        if seg.get("size") is not None:
            segment_size = _int(seg, "size", "mopd.segments.size", default=None, minimum=1)
        setting = _choice(mopd, "setting", "mopd.setting", SETTINGS, default=ScheduleConfig.setting)
        cfg = cls(
            order=order,
            domains=domains,
            budget=budget,
            block_size=block_size,
            replay=replay,
            recovery=recovery,
            joint=joint,
            segment_size=segment_size,
            setting=setting,
        )
        cfg.check_setting()
        return cfg

    # ------------------------------------------------------------------ setting (what may be kept)
    def check_setting(self) -> None:
        """Refuse configurations that need models the declared ``mopd.setting`` does not keep (MOPD paper §3.1)."""
        s = self.setting
        if self.joint.enabled:
            if s != "S2":
                raise ValueError(
                    f"mopd.joint.enabled=true under mopd.setting={s}: joint MOPD needs every expert at the same "
                    "time, which only S2 keeps. Set mopd.setting=S2 or mopd.joint.enabled=false."
                )
            if self.budget != "seq" or self.recovery.enabled or self.segment_size is not None:
                raise ValueError(
                    "mopd.joint.enabled=true replaces the whole sequence (it starts from pi_0 and trains every "
                    "domain at once), so it takes no replay budget, recovery or segments: set mopd.budget=seq, "
                    "mopd.recovery.enabled=false and mopd.segments.size=null."
                )
        if s == "S1":
            if self.replay.teachers == "experts" and self.budget != "seq":
                raise ValueError(
                    "mopd.replay.teachers=experts under mopd.setting=S1: replay toward each earlier domain's expert "
                    "needs every expert kept until the end, but S1 keeps only E_k and M_{k-1}. Set "
                    "mopd.setting=S2 to keep them, or mopd.replay.teachers=previous (replay toward M_{k-1})."
                )
            if self.recovery.enabled:
                raise ValueError(
                    "mopd.recovery.enabled=true under mopd.setting=S1: a recovery stage needs every stage "
                    "snapshot M_1..M_K (or every expert) kept until the end, but S1 keeps only E_k and M_{k-1}. "
                    "Set mopd.setting=S2 to keep them, or mopd.recovery.enabled=false."
                )
            if self.segment_size is not None:
                raise ValueError(
                    "mopd.segments.size is set under mopd.setting=S1: segment-wise consolidation keeps the "
                    "snapshots of a segment (scenario S3). Set mopd.setting=S3 or mopd.segments.size=null."
                )
        elif s == "S2":
            if self.segment_size is not None:
                raise ValueError(
                    "mopd.segments.size is set under mopd.setting=S2: segments are scenario S3 (S2 inside a "
                    "segment, S1 between segments). Set mopd.setting=S3 or mopd.segments.size=null."
                )
        elif s == "S3":
            if self.segment_size is None:
                raise ValueError(
                    "mopd.setting=S3 needs mopd.segments.size (stages per segment, e.g. 5 for 15 stages in 3 "
                    "segments); or use mopd.setting=S2 for one final recovery."
                )
            if not self.recovery.enabled:
                raise ValueError(
                    "mopd.setting=S3 ends every segment with a recovery stage: set mopd.recovery.enabled=true "
                    "(mopd.recovery.teachers and .blocks_per_domain choose how)."
                )


# ---------------------------------------------------------------------- field helpers
def _is_missing(v: Any) -> bool:
    return v is None or v == MISSING


def _section(parent: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    v = parent.get(name)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"mopd.{name}: expected a mapping, got {v!r}")
    return v


def _int(sec: Mapping[str, Any], name: str, key: str, default: int | None, minimum: int) -> int:
    v = sec.get(name, default)
    if _is_missing(v):
        if default is None:
            raise ValueError(f"{key}: required integer >= {minimum}")
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key}: expected an integer >= {minimum}, got {v!r}")
    if v < minimum:
        raise ValueError(f"{key}: must be >= {minimum}, got {v}")
    return v


def _bool(sec: Mapping[str, Any], name: str, key: str, default: bool) -> bool:
    v = sec.get(name, default)
    if v is None:
        v = default
    if not isinstance(v, bool):
        raise ValueError(f"{key}: expected true or false, got {v!r}")
    return v


def _choice(sec: Mapping[str, Any], name: str, key: str, allowed: tuple[str, ...], default: str) -> str:
    v = sec.get(name, default)
    if v is None:
        v = default
    if v not in allowed:
        raise ValueError(f"{key}: must be one of {list(allowed)}, got {v!r}")
    return v


def _name_list(v: Any, key: str) -> tuple[str, ...]:
    if _is_missing(v):
        raise ValueError(f"{key}: required list of domain names")
    if isinstance(v, str) or not isinstance(v, (list, tuple)):
        raise ValueError(f"{key}: expected a list of domain names, got {v!r}")
    names = tuple(v)
    if not names:
        raise ValueError(f"{key}: must name at least one domain")
    for n in names:
        if not isinstance(n, str) or not n or ":" in n:
            raise ValueError(f"{key}: domain names must be non-empty strings without ':', got {n!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{key}: repeated domain in {list(names)}")
    return names


def _domain(name: str, raw: Any, block_size: int, count_rows: RowCounter | None) -> DomainSpec:
    key = f"mopd.domains.{name}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{key}: expected a mapping with prompts, expert and optional num_blocks, got {raw!r}")
    prompts = raw.get("prompts")
    prompts = None if _is_missing(prompts) else str(prompts)
    expert = raw.get("expert")
    expert = None if _is_missing(expert) else str(expert)
    nb = raw.get("num_blocks")
    if _is_missing(nb):
        if prompts is None:
            raise ValueError(
                f"{key}.num_blocks: not set and {key}.prompts is required (???) to count blocks; "
                "set one of them"
            )
        if count_rows is None:
            raise ValueError(
                f"{key}.num_blocks: not set, and no row counter was given to count the prompts of "
                f"{key}.prompts={prompts!r}; set num_blocks, or pass count_rows (the MOPD layer's "
                "schedule_from_recipe and schedule_from_dict count prompt files)"
            )
        nb = count_rows(prompts, f"{key}.prompts") // block_size  # full blocks only (module docstring)
        if nb < 1:
            raise ValueError(
                f"{key}.prompts: {prompts!r} holds fewer than mopd.block_size={block_size} prompts, "
                "so the domain has no block"
            )
    if isinstance(nb, bool) or not isinstance(nb, int):
        raise ValueError(f"{key}.num_blocks: expected an integer >= 1, got {nb!r}")
    if nb < 1:
        raise ValueError(f"{key}.num_blocks: the domain is empty ({nb} blocks); a domain needs >= 1 block")
    return DomainSpec(name=name, num_blocks=nb, prompts=prompts, expert=expert)
