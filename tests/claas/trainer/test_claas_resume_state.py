"""The pieces of a CLaaS resume, one by one (no Ray): atomic state files, the config-identity check, the buffer +
EMA + stream-position round trip, the accounting of what a killed run did after its checkpoint, the producers'
commit pause and skip list, and the SDPO EMA teacher's state file."""

from __future__ import annotations

import asyncio
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

from claas_verl.claas.replay import ReplayBuffer, ReplayEntry, load_snapshot, save_snapshot
from claas_verl.claas.replay.snapshot import atomic_write
from claas_verl.claas.trainer import resume as rs
from claas_verl.losses.advantages import EmaRewardStats
from claas_verl.losses.sdpo import EmaTeacher

IDENTITY = {"claas": {"algorithm": "reinforce_pp", "m": 4, "b_min": 4, "b_max": 64, "a_max": 2,
                      "stream": {"seed": 0, "num_splits": 2, "split_size": 3}},
            "trainer": {"experiment_name": "claas_tiny_reinforce_pp"}}


def _entry(uid: str, scenario: int, reward: float, P: int = 0) -> ReplayEntry:
    return ReplayEntry(uid=uid, scenario_id=scenario, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                       behaviour_logprob=-1.5, reward=reward, P=P)


def _state(k: int = 2, **over) -> rs.ClaasState:
    fields = dict(global_steps=k, updates=k, config=rs.config_identity(IDENTITY),
                  position=rs.StreamPosition(split=1, done=[3, 5], complete=False),
                  buffer={"file": "replay_buffer.1.pkl", "k": k, "size": 0, "uids": []},
                  matrix=[[0.5, float("nan")]], ema={"beta": 0.9, "v_min": 0.01, "baseline": 0.4, "variance": 0.2,
                                                     "count": 7})
    fields.update(over)
    return rs.ClaasState(**fields)


def _write_checkpoint(tmp_path, k: int = 2, **over) -> str:
    claas_dir = str(tmp_path / f"global_step_{k}" / rs.CLAAS_DIR)
    state = _state(k, **over)
    save_snapshot(os.path.join(claas_dir, state.buffer["file"]), ReplayBuffer(64, 4, 2).state_dict())
    rs.save_state(claas_dir, state)
    return claas_dir


# ---------------------------------------------------------------------------------------------- atomic files
def test_interrupted_write_keeps_the_previous_state_and_a_torn_temp_file_is_ignored(tmp_path):
    claas_dir = _write_checkpoint(tmp_path, 2)
    path = os.path.join(claas_dir, rs.STATE_FILE)
    before = open(path, "rb").read()

    # 1. the writer raises half-way: the previous file is untouched and the temp file is removed
    def torn(f):
        f.write(b'{"format": 1, "global_st')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, torn)
    assert open(path, "rb").read() == before
    assert [n for n in os.listdir(claas_dir) if n.endswith(".tmp")] == []

    # 2. the process dies in the middle of a write (no cleanup runs): a partial temp file stays behind
    pid = os.fork()
    if pid == 0:  # child: write half a state, then die as a SIGKILL would (no finally, no atexit)
        def die(f):
            f.write(b'{"format": 1, "global_steps": 3, "upd')
            f.flush()
            os._exit(9)

        atomic_write(path, die)
        os._exit(0)  # not reached
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 9
    leftovers = [n for n in os.listdir(claas_dir) if n.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(rs.STATE_FILE + ".")
    assert open(path, "rb").read() == before  # the committed file is the old one, whole
    state = rs.load_state(claas_dir, rs.config_identity(IDENTITY), global_steps=2)  # the torn temp is never read
    assert state.global_steps == 2 and state.position.done == [3, 5]


def test_recapturing_a_checkpoint_never_pairs_the_state_with_another_buffer(tmp_path):
    claas_dir = _write_checkpoint(tmp_path, 2)
    ident = rs.config_identity(IDENTITY)
    # a re-capture dies after writing its new snapshot, before state.json: the old pair is what loads
    new_name = rs.new_buffer_file()
    buf = ReplayBuffer(64, 4, 2)
    buf.add(_entry("late", 4, 1.0, P=2))
    save_snapshot(os.path.join(claas_dir, new_name), buf.state_dict())
    state = rs.load_state(claas_dir, ident, global_steps=2)
    assert state.buffer["file"] == "replay_buffer.1.pkl" and load_snapshot(
        os.path.join(claas_dir, state.buffer["file"]))["slots"] == []
    # the re-capture that completes names its own snapshot and removes the others
    rs.save_state(claas_dir, _state(2, buffer={"file": new_name, "k": 2, "size": 1, "uids": ["late"]}))
    assert sorted(n for n in os.listdir(claas_dir) if n.endswith(".pkl")) == [new_name]
    assert rs.load_state(claas_dir, ident, global_steps=2).buffer["uids"] == ["late"]


def test_state_round_trip_nan_cells_and_positions(tmp_path):
    claas_dir = _write_checkpoint(tmp_path, 2)
    state = rs.load_state(claas_dir, rs.config_identity(IDENTITY), global_steps=2)
    assert state.matrix[0][0] == 0.5 and state.matrix[0][1] != state.matrix[0][1]  # NaN -> null -> NaN
    assert json.load(open(os.path.join(claas_dir, rs.STATE_FILE)))["matrix"] == [[0.5, None]]
    assert state.ema["count"] == 7 and state.updates == 2
    # split 1 (0-based) of size 3 holds global indices 3, 4, 5; 3 and 5 were committed -> only 4 is generated again
    assert state.position.remaining(3) == [4]
    assert rs.StreamPosition(split=1, done=[3], complete=True).remaining(3) == []
    assert rs.StreamPosition().remaining(3) == []


# ---------------------------------------------------------------------------------------------- refusals
def test_a_state_of_another_config_is_refused_naming_the_key(tmp_path):
    claas_dir = _write_checkpoint(tmp_path, 2)
    other = json.loads(json.dumps(IDENTITY))
    other["claas"]["a_max"] = 4
    with pytest.raises(rs.ResumeMismatch, match=r"claas\.a_max=2 but this run has claas\.a_max=4"):
        rs.load_state(claas_dir, rs.config_identity(other), global_steps=2)
    other = json.loads(json.dumps(IDENTITY))
    other["trainer"]["experiment_name"] = "claas_tiny_sdpo"  # another recipe
    with pytest.raises(rs.ResumeMismatch, match="trainer.experiment_name='claas_tiny_reinforce_pp'"):
        rs.load_state(claas_dir, rs.config_identity(other), global_steps=2)
    other = json.loads(json.dumps(IDENTITY))
    other["claas"]["stream"]["split_size"] = 20  # nested values compare whole
    with pytest.raises(rs.ResumeMismatch, match="claas.stream="):
        rs.load_state(claas_dir, rs.config_identity(other), global_steps=2)
    # a select function (the trainer passes OmegaConf.select) gives the same identity as the nested dict
    assert rs.config_identity(lambda k: rs._lookup(IDENTITY, k)) == rs.config_identity(IDENTITY)


def test_torn_or_foreign_checkpoints_are_refused_with_the_path(tmp_path):
    ident = rs.config_identity(IDENTITY)
    claas_dir = _write_checkpoint(tmp_path, 2)
    with pytest.raises(rs.ResumeMismatch, match="global_steps=2 but sits in the folder of step 3"):
        rs.load_state(claas_dir, ident, global_steps=3)
    os.remove(os.path.join(claas_dir, "replay_buffer.1.pkl"))
    with pytest.raises(rs.ResumeMismatch, match="replay_buffer.1.pkl is missing"):
        rs.load_state(claas_dir, ident)
    empty = tmp_path / "global_step_5" / rs.CLAAS_DIR
    empty.mkdir(parents=True)
    with pytest.raises(rs.ResumeMismatch, match="resume_mode=disable"):
        rs.load_state(str(empty), ident)
    (empty / rs.STATE_FILE).write_text(json.dumps({**_state(5).to_json(), "format": 99}))
    with pytest.raises(rs.ResumeMismatch, match="format=99"):
        rs.load_state(str(empty), ident)
    bad_k = _write_checkpoint(tmp_path, 6, buffer={"file": "replay_buffer.1.pkl", "k": 5, "size": 0, "uids": []})
    with pytest.raises(rs.ResumeMismatch, match="buffer k=5 != global_steps=6"):
        rs.load_state(bad_k, ident)


# ---------------------------------------------------------------------------------------------- buffer + EMA
def test_buffer_and_ema_resume_exactly(tmp_path):
    buf = ReplayBuffer(b_max=8, b_min=2, a_max=1, seed=3)
    buf.add([_entry(f"u{i}", i, float(i % 2)) for i in range(5)])
    buf.sample(2)
    buf.on_update()
    ema = EmaRewardStats()
    ema.update_many([0.0, 1.0, 1.0])
    path = save_snapshot(str(tmp_path / rs.new_buffer_file()), buf.state_dict())

    restored = ReplayBuffer(b_max=8, b_min=2, a_max=1, seed=99)  # another seed: the RNG state comes from the file
    restored.load_state_dict(load_snapshot(path))
    ema2 = EmaRewardStats(b0=0.0)
    ema2.load_state_dict(json.loads(json.dumps(ema.state_dict())))  # through state.json
    assert restored.update_count == buf.update_count == 1
    assert [e.uid for e in restored.entries()] == [e.uid for e in buf.entries()]
    assert [e.uid for e in restored.sample(2)] == [e.uid for e in buf.sample(2)]  # same draws after resume
    ema.update(1.0)
    ema2.update(1.0)
    assert (ema2.baseline, ema2.variance, ema2.count) == (ema.baseline, ema.variance, ema.count)
    with pytest.raises(ValueError, match="a_max=1 but this buffer has a_max=2"):
        ReplayBuffer(b_max=8, b_min=2, a_max=2).load_state_dict(load_snapshot(path))


# ---------------------------------------------------------------------------------------------- trace accounting
def test_discarded_since_counts_only_the_killed_runs_work_after_the_checkpoint():
    trace = [
        {"event": "start"}, {"event": "commit", "scenario": 0, "accepted": 2}, {"event": "update", "global_steps": 1},
        {"event": "claas_state", "global_steps": 1}, {"event": "commit", "scenario": 1, "accepted": 2},
        # the first run was resumed from step 1; the second run is the killed one
        {"event": "start"}, {"event": "resume", "global_steps": 1},
        {"event": "commit", "scenario": 2, "accepted": 1}, {"event": "update", "global_steps": 2},
        {"event": "claas_state", "global_steps": 2}, {"event": "commit", "scenario": 4, "accepted": 2},
        {"event": "update", "global_steps": 3}, {"event": "commit", "scenario": 5, "accepted": 1},
    ]
    assert rs.discarded_since(trace, 2) == {"updates": 1, "scenarios": [4, 5], "entries_accepted": 3}
    # resumed from step 1 although the killed run checkpointed step 2 later (kill before verl's tracker moved):
    # everything the killed run did is discarded
    assert rs.discarded_since(trace, 1) == {"updates": 2, "scenarios": [2, 4, 5], "entries_accepted": 4}


def test_read_trace_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "claas_trace.jsonl"
    path.write_text('{"event": "start"}\n{"event": "commit", "scenario": 1, "accepted": 2}\n{"event": "comm')
    assert [r["event"] for r in rs.read_trace(str(path))] == ["start", "commit"]
    assert rs.read_trace(str(tmp_path / "absent.jsonl")) == []


# ---------------------------------------------------------------------------------------------- producers
class _Tok:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


class _Replay:
    """``add.remote`` over a plain buffer, awaitable as a Ray ObjectRef is."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.add = SimpleNamespace(remote=self._add)

    def _add(self, entries):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.buffer.add(entries))
        return fut


def _scenarios(n):
    from claas_verl.claas.envs import Scenario, Verdict

    return [Scenario(scenario_id=f"s{i}", system_prompt="sys", user_turns=("hi",),
                     verifier=lambda text, ctx: Verdict(True)) for i in range(n)]


def test_producer_pauses_commits_for_a_capture_and_skips_committed_scenarios():
    from claas_verl.claas.trainer import ChatRenderer, RolloutProducer

    calls = []

    async def generate(request_id, prompt_ids, sampling_params):
        calls.append(request_id)
        await asyncio.sleep(0)
        return SimpleNamespace(token_ids=[1, 2], log_probs=[-0.5, -0.5], extra_fields={"global_steps": 0})

    async def main():
        buf = ReplayBuffer(b_max=64, b_min=1, a_max=5)
        ema = EmaRewardStats()
        prod = RolloutProducer(generate, ChatRenderer(_Tok()), _Replay(buf), max_new_tokens=4, ema_stats=ema)
        commits = []
        prod.on_commit = commits.append
        release = asyncio.Event()
        captured = {}

        async def capture():
            task = asyncio.create_task(prod.run_split(_scenarios(3), index_offset=3, skip=[4]))
            for _ in range(200):  # generation finishes (grading runs in a thread); the commits wait for the pause
                await asyncio.sleep(0.01)
                if len(calls) == 2:
                    break
            await asyncio.sleep(0.1)
            captured.update(generated=len(calls), size=len(buf), done=set(prod.done), count=ema.count)
            release.set()
            return task

        task = await prod.paused(capture)
        await task
        # generated during the capture, committed only after it
        assert captured == {"generated": 2, "size": 0, "done": set(), "count": 0}
        assert sorted(c["scenario"] for c in commits) == [3, 5]  # 4 was committed before the checkpoint
        assert prod.done == {3, 5} and len(buf) == 2 and ema.count == 2
        assert sorted(e.scenario_id for e in buf.entries()) == [3, 5]
        state = json.loads(json.dumps(prod.state_dict()))
        other = RolloutProducer(generate, ChatRenderer(_Tok()), None, max_new_tokens=4)
        other.load_state_dict(state)
        assert other.done == {3, 5} and other.stats.entries_accepted == 2 and other.stats.scenarios == 2

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- SDPO teacher
class _Lora(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = torch.nn.Parameter(torch.randn(3, 3, generator=g), requires_grad=False)
        self.lora_A = torch.nn.Parameter(torch.randn(2, 3, generator=g))
        self.lora_B = torch.nn.Parameter(torch.randn(3, 2, generator=g))


def test_sdpo_teacher_state_round_trip(tmp_path):
    student = _Lora(0)
    teacher = EmaTeacher(student, tau=0.1)
    rng = random.Random(0)
    for _ in range(3):  # student moves, teacher follows
        with torch.no_grad():
            student.lora_A.add_(rng.random())
        teacher.update(student)
    probe = {"ema_updates": 3, "steps_applied": 3, "steps_skipped": 1}
    path = rs.save_teacher_state(teacher, probe, str(tmp_path), rank=0)
    assert os.path.basename(path) == "sdpo_teacher_rank0.pt"

    fresh = EmaTeacher(_Lora(1), tau=0.1)  # θ_T = θ⁰ of another start
    assert rs.load_teacher_state(fresh, str(tmp_path), rank=0) == probe
    assert fresh.num_updates == 3
    for n in teacher.params:
        assert torch.equal(fresh.params[n], teacher.params[n])
    # the next EMA step is the same from both
    teacher.update(student)
    fresh.update(student)
    for n in teacher.params:
        assert torch.equal(fresh.params[n], teacher.params[n])

    with pytest.raises(rs.ResumeMismatch, match="sdpo_teacher_rank1.pt is missing"):
        rs.load_teacher_state(fresh, str(tmp_path), rank=1)
    wide = torch.nn.Module()
    wide.lora_A = torch.nn.Parameter(torch.zeros(4, 3))
    wide.lora_B = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(rs.ResumeMismatch, match=r"params\['lora_A'\] has shape \(2, 3\)"):
        rs.load_teacher_state(EmaTeacher(wide), str(tmp_path), rank=0)


def test_teacher_fingerprint_sees_every_bit_of_every_tensor():
    """The resumed worker reports ``tensors_sha256`` of its restored teacher (the service SDPO end-to-end test compares
    it with the saved file's): equal for equal bytes, different for one ulp, another name, dtype or shape."""
    teacher = EmaTeacher(_Lora(0), tau=0.1)
    saved = {n: t.clone() for n, t in teacher.params.items()}
    assert rs.tensors_sha256(teacher.params) == rs.tensors_sha256(saved)
    ulp = {**saved, "lora_A": saved["lora_A"].clone()}
    ulp["lora_A"].view(-1)[0] = torch.nextafter(ulp["lora_A"].view(-1)[0], torch.tensor(float("inf")))
    renamed = {"lora_a" if n == "lora_A" else n: t for n, t in saved.items()}
    half = {n: t.half() for n, t in saved.items()}
    reshaped = {n: t.reshape(-1) for n, t in saved.items()}
    prints = {rs.tensors_sha256(x) for x in (saved, ulp, renamed, half, reshaped)}
    assert len(prints) == 5


# ---------------------------------------------------------------------------------------------- chat API writes
def test_chat_api_writes_pause_and_drain_for_a_capture():
    import concurrent.futures
    import threading
    import time

    from claas_verl.claas.service.sinks import ActorSink

    pending: list[concurrent.futures.Future] = []

    class Handle:  # add.remote(...) -> an object ref whose .future() completes when the test says so
        def __init__(self):
            self.add = SimpleNamespace(remote=self._add)

        def _add(self, batch):
            fut = concurrent.futures.Future()
            pending.append(fut)
            return SimpleNamespace(future=lambda: fut)

    accepted = []
    sink = rs.pausable_sink(ActorSink)(Handle(), on_accepted=lambda entries, n: accepted.append(n))
    sink.submit([_entry("a", 0, 1.0)])  # in flight: its callback has not run
    drained = threading.Event()

    def capture():
        with sink.paused(timeout_s=5):
            drained.set()
            time.sleep(0.2)  # a write submitted now must wait for the end of the capture

    t = threading.Thread(target=capture)
    t.start()
    time.sleep(0.1)
    assert not drained.is_set()  # the capture waits for the write in flight and its EMA callback
    pending[0].set_result(1)
    assert drained.wait(2) and accepted == [1]
    t0 = time.monotonic()
    queued = sink.submit([_entry("b", 1, 0.0)])  # returns at once (the chat API's event loop never waits) ...
    assert time.monotonic() - t0 < 0.05 and not queued.done()
    assert len(pending) == 1  # ... but is sent only after the capture
    t.join()
    assert len(pending) == 2 and sink.stats()["in_flight"] == 1 and not queued.done()
    pending[1].set_result(1)
    assert queued.result(2) == 1 and accepted == [1, 1]  # acknowledged once the buffer took it


def test_stream_identity_ignores_the_later_split_groups_keys_at_their_defaults():
    # a checkpoint written before claas.stream.split_groups/group_key existed stays resumable ...
    old = rs.config_identity(IDENTITY)
    new_cfg = {**IDENTITY, "claas": {**IDENTITY["claas"], "stream": {
        **IDENTITY["claas"]["stream"], "split_groups": None, "group_key": "families"}}}
    rs.check_identity(old, rs.config_identity(new_cfg), "checkpoint")
    # ... but a grouped stream is another stream
    grouped = {**IDENTITY, "claas": {**IDENTITY["claas"], "stream": {
        **IDENTITY["claas"]["stream"], "split_groups": ["lowercase", "capital_start"], "group_key": "families"}}}
    with pytest.raises(rs.ResumeMismatch, match="claas.stream"):
        rs.check_identity(old, rs.config_identity(grouped), "checkpoint")
