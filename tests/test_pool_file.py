"""The pool file: saves are atomic (a crash mid-write leaves the previous file whole), and a file
that is truncated, corrupt, incomplete or saved for other settings is refused with a message that
names `pool_load_path` and the reason, at engine configuration rather than in a worker."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from conftest import DEVICE, bare_proposer

from vllm_ouroboros.config import OuroborosConfig, OuroborosConfigError, validate
from vllm_ouroboros.pool import PhrasePool, PoolFileError


def small_pool(L=4, W=4, vocab=384) -> PhrasePool:
    pool = PhrasePool(vocab, L, W, 2**16, device=DEVICE)
    keys = torch.arange(10)
    pool.insert(keys, torch.arange(10 * L).view(10, L) % vocab, torch.zeros(10, dtype=torch.long))
    return pool


def test_save_is_atomic_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "pool.pt"
    pool = small_pool()
    pool.save(path)
    before = path.read_bytes()
    pool.insert(torch.tensor([20]), torch.tensor([[1, 2, 3, 4]]), torch.tensor([0]))

    def dies_mid_write(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # the engine killed while saving

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        pool.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before  # tempting: torch.save(path) truncates it first
    assert os.listdir(tmp_path) == ["pool.pt"]  # no temporary file left behind
    assert PhrasePool.load(path, device=DEVICE).stats()["phrases"] == 10


def test_truncated_and_corrupt_files_are_refused(tmp_path):
    path = tmp_path / "pool.pt"
    small_pool().save(path)
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "noise.pt").write_bytes(os.urandom(4096))
    for name in ("cut.pt", "noise.pt"):
        with pytest.raises(PoolFileError, match="truncated, corrupt or not written by"):
            PhrasePool.load(tmp_path / name)


def test_incomplete_or_inconsistent_state_is_refused(tmp_path):
    sd = small_pool().state_dict()
    torch.save({k: v for k, v in sd.items() if k != "stamp"}, tmp_path / "a.pt")
    with pytest.raises(PoolFileError, match="missing stamp"):
        PhrasePool.read_state(tmp_path / "a.pt")
    torch.save(dict(sd, tokens=sd["tokens"][:, :, :2]), tmp_path / "b.pt")
    with pytest.raises(PoolFileError, match="tokens of shape"):
        PhrasePool.read_state(tmp_path / "b.pt")
    torch.save(dict(sd, page_key=sd["page_key"].fill_(999)), tmp_path / "c.pt")
    with pytest.raises(PoolFileError, match="outside the vocabulary"):
        PhrasePool.read_state(tmp_path / "c.pt")
    torch.save([1, 2, 3], tmp_path / "d.pt")
    with pytest.raises(PoolFileError, match="holds a list"):
        PhrasePool.read_state(tmp_path / "d.pt")
    twice = small_pool().state_dict()  # its pages hold keys 0..9 (small_pool)
    assert (twice["page_key"][:2] >= 0).all()
    twice["page_key"][1] = twice["page_key"][0]
    torch.save(twice, tmp_path / "e.pt")
    with pytest.raises(PoolFileError, match="a key on more than one page"):
        PhrasePool.read_state(tmp_path / "e.pt")


def test_config_refuses_bad_pool_files_naming_the_key(tmp_path):
    good = tmp_path / "good.pt"
    small_pool().save(good)
    data = good.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:100])

    def check(path, **kw):
        # The pool is checked before the draft directory, so none is needed here.
        return validate(OuroborosConfig(draft_model="", pool_load_path=str(path), **kw), 384)

    with pytest.raises(OuroborosConfigError, match="'pool_load_path' .*cut.pt' cannot be read"):
        check(tmp_path / "cut.pt")
    with pytest.raises(OuroborosConfigError, match="saved with beta=5, but this deployment has beta=4"):
        check(good, beta=4)
    # another window_size loads, re-cut (tests/test_pool.py::test_load_into_another_window_size)
    with pytest.raises(OuroborosConfigError, match="the draft model is missing"):
        check(good, window_size=6)
    with pytest.raises(OuroborosConfigError, match="vocabulary of 384 tokens; the target has 500"):
        validate(OuroborosConfig(draft_model="", pool_load_path=str(good)), 500)
    # A good file passes the pool check and reaches the next one (the draft directory).
    with pytest.raises(OuroborosConfigError, match="the draft model is missing"):
        check(good)


def test_engine_configuration_refuses_a_truncated_pool(tiny_models, tmp_path):
    from test_config import engine_config

    path = tmp_path / "pool.pt"
    small_pool().save(path)
    path.write_bytes(path.read_bytes()[:-64])
    spec = {"method": "ouroboros", "model": str(tiny_models["draft"]), "pool_load_path": str(path)}
    with pytest.raises(OuroborosConfigError, match="'pool_load_path' .* cannot be read as a saved phrase pool"):
        engine_config(tiny_models["target"], spec)


def test_a_save_that_fails_while_serving_does_not_fail_the_step(tmp_path, caplog):
    """The disk fills or the directory goes away after start-up: the periodic save logs once
    and serving goes on (it raised out of the step, failing every request in it); a later save
    that works says so."""
    import logging

    from vllm_ouroboros import LOGGER_NAME

    folder = tmp_path / "pools"
    saver = pool_saver(folder / "pool.pt", PhrasePool(16, 2, 2, PhrasePool.budget_for(16, 2, 2, 4), device=DEVICE))
    logging.getLogger(LOGGER_NAME).addHandler(caplog.handler)
    try:
        caplog.set_level(logging.INFO, logger=LOGGER_NAME)
        for _ in range(3):
            saver.save_now()
        folder.mkdir()
        saver.save_now()
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(caplog.handler)
    # (a record may come twice: through our handler and through the root logger's)
    failed = {id(r) for r in caplog.records if "could not be saved" in r.getMessage()}
    assert len(failed) == 1 and (folder / "pool.pt").exists()
    assert any("saved to" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def test_config_refuses_a_pool_save_path_it_could_not_write(tmp_path):
    from vllm_ouroboros.config import _validate_pool_save_path

    for path, message in ((tmp_path / "missing" / "pool.pt", "does not exist"), (tmp_path, "is a directory")):
        with pytest.raises(OuroborosConfigError, match=message):
            _validate_pool_save_path(str(path))
    _validate_pool_save_path(str(tmp_path / "pool.pt"))  # a new file in a writable directory


def test_a_disk_filling_mid_write_and_the_periodic_save_on_a_thread(tmp_path, caplog, monkeypatch):
    """A disk that fills part way through the file makes torch.save raise RuntimeError ("unexpected
    pos"), not OSError: it escaped the step and stopped the engine. It is logged once, like a
    missing directory. The periodic save writes on a thread (the step only copies the pool to the
    host) and one at a time; a save at exit waits for it and writes in the caller."""
    import logging
    import threading

    from vllm_ouroboros import LOGGER_NAME

    saver = pool_saver(tmp_path / "pool.pt", PhrasePool(16, 2, 2, PhrasePool.budget_for(16, 2, 2, 4), device=DEVICE))
    real = PhrasePool.write_state
    gate = threading.Event()
    writers = []

    entered = threading.Event()

    def full_disk(sd, path):
        writers.append(threading.current_thread().name)
        entered.set()
        gate.wait(10)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 178624 vs 178576")

    monkeypatch.setattr(PhrasePool, "write_state", staticmethod(full_disk))
    logging.getLogger(LOGGER_NAME).addHandler(caplog.handler)
    try:
        saver.maybe_save()  # the periodic save: queued on a thread, the step goes on
        assert entered.wait(10)  # the thread has reached the write (start() does not wait for it)
        assert writers == ["ouroboros-pool-save"] and saver.writing
        saver.last_save = -float("inf")
        saver.maybe_save()  # the next interval's, while one is under way: skipped
        assert len(writers) == 1
        gate.set()
        saver.join(10)
        saver.last_save = -float("inf")
        saver.maybe_save()
        saver.join(10)
        monkeypatch.setattr(PhrasePool, "write_state", staticmethod(real))
        saver.save_now()  # at exit: waited for
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(caplog.handler)
    failed = {id(r) for r in caplog.records if "could not be saved" in r.getMessage()}
    assert len(failed) == 1 and "RuntimeError" in caplog.text and (tmp_path / "pool.pt").exists()
    assert PhrasePool.read_state(str(tmp_path / "pool.pt"))["phrases_per_key"] == 2


def pool_saver(path, pool=None, lock=None, version=None):
    """A PoolSaver of `pool` (default small_pool()) to `path`, nothing staged to flush."""
    from vllm_ouroboros.pool_saver import PoolSaver

    return PoolSaver(small_pool() if pool is None else pool, str(path), lock or threading.RLock(), lambda: None,
                     version)


def saving_proposer(path):
    """A proposer with a small pool and a save path, nothing else (no model, no engine)."""
    p = bare_proposer()
    p.cfg = OuroborosConfig(draft_model="unused", pool_save_path=str(path))
    p.pool, p._writer = small_pool(), None
    p._saver = pool_saver(path, p.pool, p._pool_lock, lambda: p._pool_version)
    return p


def test_a_save_on_request_counts_for_the_periodic_one_and_a_save_at_exit_needs_no_thread(tmp_path, monkeypatch):
    """The save RPC (proposer.save_pool) writes now, and the step's next periodic save waits its
    interval from there; at interpreter exit Python 3.12+ starts no thread, so the exit
    handler's save writes in the caller."""
    p = saving_proposer(tmp_path / "pool.pt")
    p.save_pool()
    assert (tmp_path / "pool.pt").exists()
    (tmp_path / "pool.pt").unlink()
    p._saver.maybe_save()  # within the interval of the save on request: nothing
    p._saver.join(10)
    assert not (tmp_path / "pool.pt").exists()

    def no_thread(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    p._saver.save_now()
    assert PhrasePool.read_state(str(tmp_path / "pool.pt"))["phrases_per_key"] == 4


def test_a_save_at_shutdown_writes_only_a_pool_its_file_lacks(tmp_path, monkeypatch, caplog):
    """The engine core's save RPC and then the worker's own shutdown both save at shutdown: the
    second write, which vLLM's multiprocess executor may SIGKILL midway (leaving a pool-sized
    temporary file), is left out where the file holds the pool's version already: after a
    save at shutdown or a periodic one that worked, with no step since (the proposer's calls
    that change the pool move the version on). A failed write, another file, or a file gone
    count for nothing."""
    import logging

    from vllm_ouroboros import LOGGER_NAME, proposer
    from vllm_ouroboros.proposer import OuroborosProposer

    p = saving_proposer(tmp_path / "pool.pt")
    real, written, fail = PhrasePool.write_state, [], []

    def write(state, path):
        if fail:
            raise OSError(28, "No space left on device (test)")
        written.append(int(state["counters"][0]))
        real(state, path)

    monkeypatch.setattr(PhrasePool, "write_state", staticmethod(write))
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    p.shutdown()
    p.shutdown()
    assert written == [0], "the unchanged pool was written twice"
    # Said once, where it was written: a save that did not come shows in its absence.
    said = [r.getMessage() for r in caplog.records if "at shutdown (" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "pool.pt") in said[0], said

    def step(self, n):  # a step's pool work (a lookup moves the pool's counters)
        self.pool.lookup(torch.arange(n, device=DEVICE), torch.zeros(n, dtype=torch.long, device=DEVICE), 1)

    change = proposer._changes_pool(step)
    change(p, 3)
    p.shutdown()
    assert written == [0, 3]
    change(p, 2)
    p._saver.last_save = -float("inf")
    p._saver.maybe_save()  # the periodic save: the step's version
    p._saver.join(10)
    p.shutdown()
    assert written == [0, 3, 5], "a periodic save of this version was written again"
    p.save_pool(str(tmp_path / "other.pt"))  # another file holds nothing of pool.pt's
    change(p, 1)
    fail.append(True)
    p.shutdown()  # failed (logged): the file keeps the last version
    fail.clear()
    p.shutdown()
    assert written == [0, 3, 5, 5, 6]
    (tmp_path / "pool.pt").unlink()
    p.shutdown()
    assert written[-1] == 6 and len(written) == 6 and (tmp_path / "pool.pt").exists()
    # A step's calls that change the pool move the version on (on_verified before it reads
    # anything: no runtime here; propose's, tests/test_e2e_tiny.py's exit save).
    p.runtime, before = None, p._pool_version
    OuroborosProposer.on_verified(p, [], None)
    assert p._pool_version == before + 1


def started_until_it_waits(monkeypatch, target) -> tuple[threading.Thread, bool]:
    """`target` on a thread, returned once it waits for another thread (Thread.join) or has
    ended, with whether it waited: an event, not a sleep a slow thread start would outlast."""
    waiting, join = threading.Event(), threading.Thread.join

    def joined(thread, timeout=None):
        if threading.current_thread() is runner:
            waiting.set()
        return join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", joined)
    runner = threading.Thread(target=target)
    runner.start()
    while not waiting.is_set() and runner.is_alive():
        waiting.wait(0.01)
    return runner, waiting.is_set()


def periodic_write_held(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold the periodic save's write (on its thread) until `gate` is set; `entered` is set once
    it is under way. Writes from any other thread pass. Returns (gate, entered)."""
    real, gate, entered = PhrasePool.write_state, threading.Event(), threading.Event()

    def held(state, path):
        if threading.current_thread().name == "ouroboros-pool-save":
            entered.set()
            gate.wait(10)
        real(state, path)

    monkeypatch.setattr(PhrasePool, "write_state", staticmethod(held))
    return gate, entered


def test_a_save_on_request_waits_for_a_periodic_write_of_an_older_copy(tmp_path, monkeypatch):
    """The periodic save copies the pool, then writes on its thread; a save on request made
    while that write is under way wrote the newer pool first, and the thread's rename, landing
    after it, put the older copy back in the file."""
    p = saving_proposer(tmp_path / "pool.pt")
    gate, entered = periodic_write_held(monkeypatch)
    p._saver.maybe_save()  # the periodic save: its copy of the pool has no key 11
    assert entered.wait(10)
    p.pool.insert(torch.tensor([11]), torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, dtype=torch.long))
    request, _ = started_until_it_waits(monkeypatch, p.save_pool)  # without the wait: written by then
    gate.set()
    request.join(10)
    p._saver.join(10)
    assert not request.is_alive()
    assert int(PhrasePool.read_state(str(tmp_path / "pool.pt"))["key_to_page"][11]) >= 0, \
        "the older copy replaced the save on request"


def writes_recorded(monkeypatch) -> list[int]:
    """The lookups counter of each pool written from now on (the writes go on)."""
    real, written = PhrasePool.write_state, []

    def write(state, path):
        written.append(int(state["counters"][0]))
        real(state, path)

    monkeypatch.setattr(PhrasePool, "write_state", staticmethod(write))
    return written


def lookup_step():
    """step(proposer, n): a step's pool work as the proposer's steps change the pool (its
    version moves on), moving the lookups counter by n."""
    from vllm_ouroboros import proposer

    return proposer._changes_pool(lambda self, n: self.pool.lookup(
        torch.arange(n, device=DEVICE), torch.zeros(n, dtype=torch.long, device=DEVICE), 1))


def test_an_idle_engine_writes_the_pool_its_file_lacks(tmp_path, monkeypatch):
    """When the engine's last request is removed (the runner patch calls on_idle) the pool is
    written, unless its file holds it already: a process killed while idle (SIGKILL, Ray's
    kill) loses nothing, and the save at shutdown then writes nothing. With pool_save_on_idle
    false, no write (the periodic and shutdown saves only)."""
    p = saving_proposer(tmp_path / "pool.pt")
    written = writes_recorded(monkeypatch)
    change = lookup_step()
    change(p, 3)
    p.on_idle()
    p._saver.join(10)
    assert written == [3]
    p.on_idle()  # no step since: the file holds this pool
    p._saver.join(10)
    p.shutdown()
    assert written == [3], "a pool its file holds was written again"
    change(p, 2)
    p.cfg = OuroborosConfig(draft_model="unused", pool_save_path=str(tmp_path / "pool.pt"), pool_save_on_idle=False)
    p.on_idle()
    p._saver.join(10)
    assert written == [3]
    p.shutdown()
    assert written == [3, 5]
    assert OuroborosConfig(draft_model="m").pool_save_on_idle is True
    with pytest.raises(OuroborosConfigError, match="'pool_save_on_idle' must be true or false"):
        validate(OuroborosConfig(draft_model="m", pool_save_on_idle="no"))


def test_idle_saves_write_once_an_interval_and_defer_the_later(tmp_path, monkeypatch):
    """An engine that goes idle between requests arriving every few seconds wrote the whole pool
    per request. One idle write per interval: a later idle spell's save waits for the
    interval's end on a timer and writes if the pool is still the one the engine left (a step
    since means it served again: its next idle spell saves); a save on request holding the
    pool's lock then is waited out; a saver replaced meanwhile (a second load) writes nothing."""
    from vllm_ouroboros import pool_saver as pool_saver_module

    monkeypatch.setattr(pool_saver_module, "POOL_SAVE_INTERVAL", 0.5)
    monkeypatch.setattr(pool_saver_module, "IDLE_RETRY_S", 0.05)
    p = saving_proposer(tmp_path / "pool.pt")
    written = writes_recorded(monkeypatch)
    change = lookup_step()

    def settled(n, timeout=10.0):
        end = time.monotonic() + timeout
        while len(written) < n and time.monotonic() < end:
            time.sleep(0.01)
        p._saver.join(10)
        return written

    def idle_within_the_interval():  # whatever the machine's load: an idle save was just begun
        p._saver._last_idle_save = time.monotonic()
        p.on_idle()

    change(p, 3)
    p.on_idle()
    assert settled(1) == [3]
    change(p, 2)
    idle_within_the_interval()  # deferred
    p._saver.join(10)
    assert written == [3] and p._saver._idle_timer is not None
    assert settled(2) == [3, 5] and p._saver._holds_current()

    change(p, 1)
    idle_within_the_interval()  # deferred again
    change(p, 1)  # the engine serves before it is due
    time.sleep(0.8)
    assert settled(3, timeout=0) == [3, 5], "a pool the engine went on changing was written as idle"
    p._saver._last_idle_save -= 1.0  # the interval is over: at once
    p.on_idle()
    assert settled(3) == [3, 5, 7]

    change(p, 1)
    idle_within_the_interval()
    held = threading.Event()

    def hold_the_pool():  # a save on request, say, when the idle save is due
        with p._pool_lock:
            held.set()
            time.sleep(0.8)

    holder = threading.Thread(target=hold_the_pool)
    holder.start()
    held.wait(10)
    assert settled(4) == [3, 5, 7, 8], "the deferred save gave up on a lock held for a moment"
    holder.join(10)

    change(p, 1)
    idle_within_the_interval()
    p._saver.close()  # a second load_model replaced it: its file is the new saver's
    time.sleep(0.8)
    assert settled(5, timeout=0) == [3, 5, 7, 8], "a replaced saver's deferred save wrote its old pool"


def test_a_deferred_idle_save_copies_on_the_pools_gpu(tmp_path, monkeypatch):
    """The deferred idle save runs on a timer's thread, whose CUDA device is the first GPU: a
    worker of another GPU would open a context there (hundreds of MB) for the copy. The thread
    takes the pool's device first (a CPU pool posing as one on the second GPU here)."""
    from vllm_ouroboros import pool_saver as pool_saver_module

    monkeypatch.setattr(pool_saver_module, "POOL_SAVE_INTERVAL", 0.2)
    version = [0]
    saver = pool_saver(tmp_path / "pool.pt", version=lambda: version[0])
    saver.save_when_idle()
    saver.join(10)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append((threading.current_thread().name, d)))
    monkeypatch.setattr(saver.pool, "device", torch.device("cuda", 1))
    version[0] += 1
    saver._last_idle_save = time.monotonic()  # within the interval: deferred
    saver.save_when_idle()
    timer = saver._idle_timer
    timer.join(10)
    saver.join(10)
    assert saver._holds_current()
    assert chosen == [("ouroboros-pool-idle-save", torch.device("cuda", 1))]


def test_an_idle_save_goes_behind_a_periodic_write_of_an_older_copy(tmp_path, monkeypatch):
    """A periodic write under way when the engine goes idle holds an older copy of the pool:
    the idle copy is written after it (that write's rename, landing last, had put the older
    pool back for as long as the engine stayed idle), and the idle step does not wait for it
    (a request arriving meanwhile would wait on it: seconds on network storage). Idle spells
    while storage hangs queue one copy, the newest, not one each."""
    from vllm_ouroboros import pool_saver as pool_saver_module, proposer
    from vllm_ouroboros.pool_saver import PoolSaver

    p = saving_proposer(tmp_path / "pool.pt")
    gate, entered = periodic_write_held(monkeypatch)
    p._saver.maybe_save()  # the periodic save: its copy of the pool has no key 11
    assert entered.wait(10)

    def insert(key):
        proposer._changes_pool(lambda self: self.pool.insert(
            torch.tensor([key]), torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, dtype=torch.long)))(p)

    monkeypatch.setattr(pool_saver_module, "POOL_SAVE_INTERVAL", 0.0)  # idle spells back to back
    copies = []
    real_copy = PoolSaver._copy
    monkeypatch.setattr(PoolSaver, "_copy", lambda self: copies.append(1) or real_copy(self))
    insert(11)
    idle = threading.Thread(target=p.on_idle)
    idle.start()
    idle.join(5)
    assert not idle.is_alive(), "the idle step waited for the periodic write"
    follower = p._saver._thread
    insert(12)  # a second idle spell while the storage still hangs
    p.on_idle()
    assert len(copies) == 2 and p._saver._queued is not None
    assert p._saver._thread is follower, "each idle spell queued a writer of its own"
    gate.set()
    p._saver.join(10)
    assert not p._saver.writing and p._saver._queued is None
    key_to_page = PhrasePool.read_state(str(tmp_path / "pool.pt"))["key_to_page"]
    assert int(key_to_page[11]) >= 0 and int(key_to_page[12]) >= 0, \
        "the older copy replaced the idle save"
    assert p._saver._holds_current()


def test_a_replaced_saver_waits_for_its_periodic_write(tmp_path, monkeypatch):
    """A second load_model's saver starts with no write of its own under way: the replaced
    saver's periodic write, renamed after the new saver's first save, would put the old pool
    back. close() waits for it."""
    saver = pool_saver(tmp_path / "pool.pt")
    gate, entered = periodic_write_held(monkeypatch)
    saver.maybe_save()
    assert entered.wait(10)
    closer, waited = started_until_it_waits(monkeypatch, saver.close)
    assert waited and closer.is_alive(), "close() did not wait for the write under way"
    gate.set()
    closer.join(10)
    assert not saver.writing and (tmp_path / "pool.pt").exists()


def test_a_second_load_leaves_the_first_pools_exit_handler_out(tiny_models, tmp_path, monkeypatch):
    """Exit handlers run newest first: a second load_model's saver wrote the new pool at exit,
    then the first saver's handler wrote its own, older pool over it."""
    import atexit

    pytest.importorskip("vllm", reason="the proposer's config reads vLLM's platform; vLLM is not installed here")
    from test_proposal_room import make_proposer

    from vllm_ouroboros.pool_saver import PoolSaver

    saves = []  # the savers whose exit handler is registered
    register, unregister = atexit.register, atexit.unregister

    def registered(fn, *a, **kw):
        if getattr(fn, "__func__", None) is PoolSaver.save_now:
            saves.append(fn.__self__)
        return register(fn, *a, **kw)

    def unregistered(fn):
        if getattr(fn, "__func__", None) is PoolSaver.save_now and fn.__self__ in saves:
            saves.remove(fn.__self__)
        return unregister(fn)

    monkeypatch.setattr(atexit, "register", registered)
    monkeypatch.setattr(atexit, "unregister", unregistered)
    p = make_proposer(tiny_models, pool_save_path=str(tmp_path / "pool.pt"))
    first = p._saver
    try:
        assert saves == [first]
        p.load_model(None)
        assert p._saver is not first and saves == [p._saver]
    finally:
        first.close()
        p._saver.close()


def test_the_workers_shutdown_saves_the_pool_before_vllms_teardown(tmp_path):
    """vLLM sends its engine process SIGTERM and SIGKILLs it 5 s later; the process tears down
    its distributed state and memory before exit handlers run, so a save left to atexit was
    lost on a busy machine (the file kept the first step's pool). The worker's shutdown
    (patched) writes the pool first, with every phrase inserted since the last save."""
    import atexit

    pytest.importorskip("vllm", reason="the patched worker is vLLM's")
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_ouroboros import proposer
    from vllm_ouroboros.patches import engine_shutdown, model_runner

    model_runner.apply()
    assert getattr(Worker.shutdown, "__ouroboros_original__", None) is not None

    p = saving_proposer(tmp_path / "pool.pt")
    p._saver.maybe_save()  # the first step's periodic save: 10 keys
    p._saver.join(10)
    proposer._changes_pool(lambda self: self.pool.insert(  # a step's inserts
        torch.arange(30, 40), torch.ones(10, 4, dtype=torch.long), torch.zeros(10, dtype=torch.long)))(p)
    p._saver.register_exit()

    order = []

    def teardown(worker):
        keys = PhrasePool.read_state(str(tmp_path / "pool.pt"))["page_key"]
        order.append(len(keys[keys >= 0].unique()))

    worker = object.__new__(Worker)
    worker.model_runner = type("Runner", (), {"drafter": p})()
    engine_shutdown._worker_shutdown(teardown)(worker)
    assert order == [20], "the pool was not saved whole before the worker's teardown"
    # The exit handler is gone (it held the proposer, and would write the same pool again).
    assert atexit.unregister(p._saver.save_now) is None  # unregistering twice is a no-op too
    calls = []
    worker.model_runner.drafter = type("Other", (), {"shutdown": lambda self: calls.append(1)})()
    engine_shutdown._worker_shutdown(teardown)(worker)  # another drafter: left alone
    assert calls == [] and len(order) == 2


def test_the_shutdown_save_holds_signals_and_vllms_teardown_always_runs():
    """vLLM restores SIGTERM's and SIGINT's default handlers before its engine's shutdown: a
    second signal killed the process in the middle of the save. They are ignored while the
    pool is written (restored after), and vLLM's own teardown runs even where the save was
    interrupted (a KeyboardInterrupt skipped it: the device memory was never released)."""
    import signal

    from vllm_ouroboros.patches import engine_shutdown

    seen, torn_down = [], []

    class Drafter:
        is_ouroboros = True

        def __init__(self, error=None):
            self.error = error

        def shutdown(self):
            seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
            if self.error is not None:
                raise self.error

    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    worker = type("Worker", (), {})()
    teardown = engine_shutdown._worker_shutdown(lambda w: torn_down.append(w) or "done")
    worker.model_runner = type("Runner", (), {"drafter": Drafter()})()
    assert teardown(worker) == "done"
    assert seen == [(signal.SIG_IGN, signal.SIG_IGN)]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    worker.model_runner.drafter = Drafter(OSError("disk gone (test)"))
    assert teardown(worker) == "done"  # logged, teardown after
    worker.model_runner.drafter = Drafter(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        teardown(worker)
    assert len(torn_down) == 3, "vLLM's teardown was skipped"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_the_engine_core_has_the_workers_save_before_it_stops_them(tmp_path, monkeypatch):
    """vLLM's Ray executors `ray.kill` their workers without calling the worker's shutdown, and
    the multiprocess one SIGKILLs a worker 9 s after the stop it signals: the engine core's
    shutdown (patched) first asks the workers to save through a collective RPC by name, with a
    time-out, where an ouroboros pool file is written, and not where the RPC could only wait
    (the executor failed or shut down, its queue closed, a step's future pending, Ray down
    under Ray). The worker's own shutdown after it writes nothing more (the pool unchanged).
    The RPC reaches the proposer through vLLM's own dispatch (`run_method` on the worker
    wrapper, as RayWorkerWrapper.execute_method calls it). Both of vLLM's Ray executors, run for real:
    `python scripts/ray_pool_save_check.py` (needs Ray, not installed by the setup)."""
    import signal

    pytest.importorskip("vllm", reason="the patched engine core and worker wrapper are vLLM's")
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_ouroboros.patches import apply_all, engine_shutdown, model_runner
    from vllm_ouroboros.patches.engine_args import ADDITIONAL_CONFIG_KEY, PROPOSER_PATH

    apply_all()
    model_runner.apply()
    assert getattr(EngineCore.shutdown, "__ouroboros_original__", None) is not None

    p = saving_proposer(tmp_path / "pool.pt")
    worker = object.__new__(Worker)
    worker.model_runner = type("Runner", (), {"drafter": p})()
    wrapper = object.__new__(WorkerWrapperBase)
    wrapper.worker = worker

    class Executor:
        uses_ray, is_failed = True, False

        def __init__(self):
            self.calls = []

        def collective_rpc(self, method, timeout=None):
            self.calls.append((method, timeout))
            events.append(("rpc", signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
            return [run_method(wrapper, method, (), {})]

    def engine(executor, method="custom_class", model=PROPOSER_PATH, save=str(tmp_path / "pool.pt")):
        spec = type("Spec", (), {"method": method, "model": model})()
        extra = {ADDITIONAL_CONFIG_KEY: OuroborosConfig(draft_model="unused", pool_save_path=save).to_dict()}
        config = type("Config", (), {"speculative_config": spec, "additional_config": extra})()
        return type("Core", (), {"model_executor": executor, "vllm_config": config})()

    events = []
    shutdown = engine_shutdown._engine_core_shutdown(lambda core: events.append("teardown") or "done")
    monkeypatch.setattr(engine_shutdown, "_ray_running", lambda: True)
    ray = Executor()
    assert shutdown(engine(ray)) == "done"
    assert ray.calls == [(engine_shutdown.SAVE_METHOD, engine_shutdown.SAVE_RPC_TIMEOUT_S)]
    # The save first, signals held (vLLM restored their defaults before), then the teardown.
    assert events == [("rpc", signal.SIG_IGN, signal.SIG_IGN), "teardown"], events
    assert PhrasePool.read_state(str(tmp_path / "pool.pt"))["phrases_per_key"] == 4

    multiprocess = Executor()
    multiprocess.uses_ray = False
    monkeypatch.setattr(engine_shutdown, "_ray_running", lambda: False)  # not asked: no Ray
    (tmp_path / "pool.pt").unlink()
    assert shutdown(engine(multiprocess)) == "done"
    assert multiprocess.calls == ray.calls and (tmp_path / "pool.pt").exists()
    # The worker's shutdown, which vLLM's executor stops by SIGKILL 9 s in, writes nothing more.
    written = []
    monkeypatch.setattr(PhrasePool, "write_state", staticmethod(lambda state, path: written.append(path)))
    assert engine_shutdown.save_pool(worker) and written == []
    monkeypatch.undo()
    monkeypatch.setattr(engine_shutdown, "_ray_running", lambda: True)

    # Where an RPC could only wait out its time-out (or past it), or nothing needs it: none.
    others = {name: Executor() for name in ("failed", "shut down", "step pending",
                                            "queue closed", "other method", "no save path")}
    others["failed"].is_failed = True
    others["shut down"].shutting_down = True
    others["step pending"].futures_queue = ["a step's future"]
    others["queue closed"].rpc_broadcast_mq = None
    for name, executor in others.items():
        shutdown(engine(executor, method="ngram", model=None) if name == "other method" else
                 engine(executor, save=None) if name == "no save path" else engine(executor))
    monkeypatch.setattr(engine_shutdown, "_ray_running", lambda: False)  # at interpreter exit
    ray_down = Executor()
    shutdown(engine(ray_down))
    assert {n: e.calls for n, e in others.items() if e.calls} == {} and ray_down.calls == []
    assert events.count("teardown") == 9

    class Timeout(Executor):
        def collective_rpc(self, method, timeout=None):
            raise TimeoutError("a worker did not answer (test)")

    monkeypatch.setattr(engine_shutdown, "_ray_running", lambda: True)
    assert shutdown(engine(Timeout())) == "done" and events.count("teardown") == 10, "vLLM's teardown was skipped"


def test_a_save_from_another_thread_waits_for_the_step_under_way(tmp_path, caplog, monkeypatch):
    """Under vLLM's Ray executors a worker's steps run on the compiled graph's thread while the
    engine core's save RPC runs on the actor's thread: the save waits for the step to leave the
    pool (it read a pool halfway through a step's inserts). A step that holds the pool past
    SAVE_NOW_TIMEOUT_S costs the save (logged), not the engine's exit."""
    import logging

    from vllm_ouroboros import LOGGER_NAME, proposer
    from vllm_ouroboros import pool_saver as pool_saver_module

    p = saving_proposer(tmp_path / "pool.pt")
    in_step, leave = threading.Event(), threading.Event()
    order = []

    def step(self):  # a step's pool work, as propose() and on_verified() hold it
        order.append("step starts")
        in_step.set()
        leave.wait(10)
        self.pool.insert(torch.arange(30, 40), torch.ones(10, 4, dtype=torch.long),
                         torch.zeros(10, dtype=torch.long))
        order.append("step ends")

    runner = threading.Thread(target=proposer._changes_pool(step), args=(p,))
    runner.start()
    assert in_step.wait(10)
    trying = threading.Event()  # the save has asked for the pool's lock

    class Lock:
        def acquire(self, *a, **kw):
            trying.set()
            return p._pool_lock.acquire(*a, **kw)

        def release(self):
            p._pool_lock.release()

    real_lock, p._saver.lock = p._saver.lock, Lock()
    saver = threading.Thread(target=lambda: (p.shutdown(), order.append("saved")))
    saver.start()
    while not trying.is_set() and saver.is_alive():  # no sleep to guess how long a start takes
        trying.wait(0.01)
    assert saver.is_alive() and order == ["step starts"], "the save did not wait for the step"
    leave.set()
    runner.join(10)
    saver.join(10)
    assert order == ["step starts", "step ends", "saved"]
    p._saver.lock = real_lock
    keys = PhrasePool.read_state(str(tmp_path / "pool.pt"))["page_key"]
    assert len(keys[keys >= 0].unique()) == 20, "the save missed the step's inserts"

    # A step that never leaves: the save gives up after the bound and says so.
    monkeypatch.setattr(pool_saver_module, "SAVE_NOW_TIMEOUT_S", 0.2)
    (tmp_path / "pool.pt").unlink()
    leave.clear()
    in_step.clear()
    stuck = threading.Thread(target=proposer._holds_pool(lambda self: (in_step.set(), leave.wait(10))), args=(p,))
    stuck.start()
    assert in_step.wait(10)
    logging.getLogger(LOGGER_NAME).addHandler(caplog.handler)
    try:
        p.shutdown()
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(caplog.handler)
        leave.set()
        stuck.join(10)
    assert not (tmp_path / "pool.pt").exists() and "held the phrase pool" in caplog.text


def test_a_save_at_shutdown_gives_up_on_storage_that_hangs(tmp_path, caplog, monkeypatch):
    """SIGTERM and SIGINT are held while the pool is written at shutdown, and an in-process
    engine has no SIGKILL to end a write that hangs (network storage): a periodic write still
    under way, and then the shutdown's own, are waited for SAVE_NOW_TIMEOUT_S at most (logged);
    the file, replaced atomically, keeps the last save."""
    import logging

    from vllm_ouroboros import LOGGER_NAME
    from vllm_ouroboros import pool_saver as pool_saver_module

    p = saving_proposer(tmp_path / "pool.pt")
    p._saver.save_now()
    saved = (tmp_path / "pool.pt").read_bytes()
    monkeypatch.setattr(pool_saver_module, "SAVE_NOW_TIMEOUT_S", 0.2)
    hang, entered = threading.Event(), threading.Event()
    monkeypatch.setattr(PhrasePool, "write_state", staticmethod(lambda state, path: (entered.set(), hang.wait(60))))
    logging.getLogger(LOGGER_NAME).addHandler(caplog.handler)
    try:
        p._saver.last_save = -float("inf")
        p._saver.maybe_save()  # the periodic save: on its thread, hung
        assert entered.wait(10) and p._saver.writing
        t0 = time.monotonic()
        p.shutdown()  # waits for the hung write, gives up (not the hang's 60 s)
        assert time.monotonic() - t0 < 30 and "still writing at the end" in caplog.text
        hang.set()
        p._saver.join(10)
        hang.clear()
        t0 = time.monotonic()
        p._saver.save_now()  # its own write hangs: given up too
        assert time.monotonic() - t0 < 30 and "did not finish in the" in caplog.text
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(caplog.handler)
        hang.set()
    assert (tmp_path / "pool.pt").read_bytes() == saved


def test_a_save_at_shutdown_has_one_deadline_for_all_its_waits(tmp_path, caplog, monkeypatch):
    """A step that holds the pool, then a periodic write still under way: the shutdown's waits
    share one deadline (SAVE_NOW_TIMEOUT_S), below the engine process's grace and the Ray RPC's
    time-out. With a bound per wait they summed to 60 s, past vLLM's SIGKILL after the 15 s
    grace (and the RPC's 30 s), so the engine's own teardown never ran. On a clock of its own:
    with real sleeps a loaded machine's pause made the lock wait time out."""
    import logging
    from types import SimpleNamespace

    from vllm_ouroboros import LOGGER_NAME
    from vllm_ouroboros import pool_saver as pool_saver_module
    from vllm_ouroboros.patches import engine_shutdown

    limit = pool_saver_module.SAVE_NOW_TIMEOUT_S
    assert limit < min(engine_shutdown.PROCESS_GRACE_S, engine_shutdown.SAVE_RPC_TIMEOUT_S)
    p = saving_proposer(tmp_path / "pool.pt")
    clock, waits = [100.0], []
    monkeypatch.setattr(pool_saver_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    class StepHoldsThePool:  # the step leaves the pool 0.8 limits later
        def acquire(self, timeout):
            waits.append(("lock", timeout))
            clock[0] += 0.8 * limit
            return True

        def release(self):
            pass

    class WriteUnderWay:  # the periodic write never ends
        def is_alive(self):
            return True

        def join(self, timeout=None):
            waits.append(("write", timeout))
            clock[0] += timeout or 0.0

    p._saver.lock, p._saver._thread = StepHoldsThePool(), WriteUnderWay()
    logging.getLogger(LOGGER_NAME).addHandler(caplog.handler)
    try:
        p.shutdown()
    finally:
        logging.getLogger(LOGGER_NAME).removeHandler(caplog.handler)
    assert waits == [("lock", limit), ("write", pytest.approx(0.2 * limit))], waits
    assert clock[0] == pytest.approx(100.0 + limit)
    assert "still writing at the end" in caplog.text


def test_a_save_removes_the_temporaries_of_saves_killed_long_ago(tmp_path):
    """A save killed mid-write (vLLM SIGKILLs an engine that takes over 5 s to stop) leaves a
    pool-sized temporary file; the next save removes those over an hour old, not a fresh one
    (another engine's save under way) nor other files."""
    import time

    path = tmp_path / "pool.pt"
    old, fresh, other = (tmp_path / "pool.pt.abc123.tmp", tmp_path / "pool.pt.def456.tmp",
                         tmp_path / "notes.pt.ghi789.tmp")
    for f in (old, fresh, other):
        f.write_bytes(b"x" * 100)
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    small_pool().save(path)
    assert not old.exists() and fresh.exists() and other.exists()
    assert PhrasePool.read_state(str(path))["phrases_per_key"] == 4


def test_the_engine_process_gets_time_to_write_its_pool(monkeypatch):
    """vLLM's default shutdown_timeout 0 SIGKILLs the engine-core process in the millisecond of
    its SIGTERM, and an offline LLM's finalizer 5 s after it (None: vLLM's 5 s). Where a pool is
    saved and requests are aborted at once, its process manager gives it at least
    PROCESS_GRACE_S to exit; a longer wait stands, and so does a draining deadline
    (shutdown_timeout > 0), as vLLM has them."""
    pytest.importorskip("vllm", reason="the patched process manager is vLLM's")
    from vllm.v1.engine import utils as engine_utils

    from vllm_ouroboros.patches import engine_shutdown

    engine_shutdown.apply_process_manager()
    waited = []
    monkeypatch.setattr(engine_utils, "shutdown", lambda procs, timeout=None: waited.append(timeout))

    def manager(request_timeout, saves):
        m = object.__new__(engine_utils.CoreEngineProcManager)
        m.manager_stopped = threading.Event()
        m._finalizer = type("F", (), {"detach": lambda self: ("armed",), "alive": True})()
        m.processes, m._request_shutdown_timeout, m._ouroboros_saves_pool = [], request_timeout, saves
        return m

    grace = engine_shutdown.PROCESS_GRACE_S
    cases = [((0, True), 0, grace), ((0, True), None, grace), ((0, True), 5, grace), ((0, True), 60, 60),
             ((0, False), 0, 0), ((0, False), None, None), ((0, False), 5, 5), ((5, True), 0, 0), ((5, True), 5, 5)]
    for (request_timeout, saves), timeout, expect in cases:
        waited.clear()
        manager(request_timeout, saves).shutdown(timeout=timeout)
        assert waited == [expect], (request_timeout, saves, timeout, waited)


def test_the_engine_process_gets_time_to_write_its_pool_at_interpreter_exit(monkeypatch):
    """An offline script that ends with its LLM alive: the process manager's own finalizer
    (vLLM's module-level shutdown(processes), 5 s, which the manager's shutdown method never
    sees) runs first at exit. Where a pool is saved and requests are aborted at once it gives
    the engine process PROCESS_GRACE_S; otherwise it is vLLM's."""
    import weakref

    pytest.importorskip("vllm", reason="the patched process manager is vLLM's")
    from vllm.v1.engine import utils as engine_utils

    from vllm_ouroboros.patches import engine_shutdown

    calls = []
    monkeypatch.setattr(engine_utils, "shutdown", lambda procs, timeout=None: calls.append(("grace", timeout)))
    monkeypatch.setattr(engine_shutdown, "_saves_pool", lambda saves: saves)

    class Manager:
        pass

    def vllms_init(self, vllm_config, request_timeout):  # what CoreEngineProcManager.__init__ leaves
        self.processes, self._request_shutdown_timeout = [], request_timeout
        self._finalizer = weakref.finalize(self, lambda procs: calls.append(("vllm's", None)), self.processes)

    init = engine_shutdown._proc_manager_init(vllms_init)
    for saves, request_timeout, expect in ((True, 0, ("grace", engine_shutdown.PROCESS_GRACE_S)),
                                           (False, 0, ("vllm's", None)), (True, 5, ("vllm's", None))):
        calls.clear()
        m = Manager()
        init(m, saves, request_timeout)
        m._finalizer()  # as at exit (atexit runs the live finalizers)
        assert calls == [expect], (saves, request_timeout, calls)
