"""An offline script that ends with its LLM alive (the usual batch job): the pool is written at
interpreter exit, also where the save comes late. vLLM's process manager's own finalizer,
which runs first at exit, SIGKILLed the engine process and its worker 5 s after the SIGTERM,
and vLLM's multiprocess executor SIGKILLs a worker 9 s after the stop it signals
(patches/engine_shutdown.py); loaded CI machines lost the save to both. Here the first save at
shutdown in every process of the script waits 10 s first (a sitecustomize on PYTHONPATH): past
both of vLLM's deadlines, inside the engine process's grace (PROCESS_GRACE_S) with the save
asked for by the engine core before it stops its worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm_ouroboros.metrics import engine_snapshot

if __name__ == "__main__":  # vLLM spawns its engine process: the script is imported there
    target, draft, pool = sys.argv[1:4]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              speculative_config={"method": "ouroboros", "model": draft, "pool_save_path": pool,
                                  "pool_save_on_idle": False,  # else the file is current already
                                  "use_lookahead": True, "use_guesses": True})
    llm.generate(["def fib(n):", "The quick brown fox"] * 4,
                 SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    print("LAST_SNAPSHOT", json.dumps(engine_snapshot(llm)["pool"]), flush=True)
    # no del, no shutdown: the interpreter's exit stops the engine
"""

SLOW_SAVE = """
import os, time
if os.environ.get("OUROBOROS_TEST_SAVE_DELAY_S"):
    from vllm_ouroboros import pool_saver

    _shutdown, _late = pool_saver.PoolSaver.shutdown, []

    def shutdown(self):
        if not _late:  # the first only: where a second comes, it is the worker's, after vLLM's stop
            _late.append(True)
            time.sleep(float(os.environ["OUROBOROS_TEST_SAVE_DELAY_S"]))
        _shutdown(self)

    pool_saver.PoolSaver.shutdown = shutdown
"""


def test_pool_saved_at_interpreter_exit_when_the_save_comes_late(tiny_models, tmp_path):
    from vllm_ouroboros.pool import PhrasePool

    (tmp_path / "script.py").write_text(SCRIPT)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SAVE)
    pool = tmp_path / "pool.pt"
    env = dict(os.environ, OUROBOROS_TEST_SAVE_DELAY_S="10",
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tiny_models["target"]),
                           str(tiny_models["draft"]), str(pool)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    last = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("LAST_SNAPSHOT"))
                      .split(" ", 1)[1])
    # The pool after the last step, not the save the first step made at once. (Not "no force
    # kill": a loaded machine's teardown may outlast the grace after the save.)
    state = PhrasePool.read_state(str(pool))
    assert int(state["counters"][0]) == last["lookups"] > 0, \
        (int(state["counters"][0]), last, [x for x in out.splitlines() if "shutdown" in x])
    assert int((state["stamp"] > 0).sum()) == last["phrases"] > 0
    assert not list(tmp_path.glob("pool.pt.*")), "a save was cut off"
