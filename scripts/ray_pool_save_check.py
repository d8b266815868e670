"""The pool file at engine shutdown under vLLM's Ray executor: it must hold the engine's last
pool, not the last periodic save (Ray `ray.kill`s its workers without a worker shutdown; the
engine core's patched shutdown has them save first: vllm_ouroboros/patches/engine_shutdown.py).

    pip install ray==2.60.0            # not part of the setup: Ray is optional for vLLM
    python scripts/ray_pool_save_check.py            # tiny random models built here
    python scripts/ray_pool_save_check.py --no-fix   # the same without the engine core's save:
                                                     # shows what the check catches (exit 1)

Starts a one-node Ray cluster, runs one engine with `distributed_executor_backend="ray"`, two
batches 11 s apart (past the 10 s periodic save), reads the pool file before and after the
engine's shutdown and compares the keys with the engine's last snapshot. Exit 0 when the file
after shutdown holds the snapshot's keys. vLLM's CPU platform does not support Ray (no Ray
device key); without a GPU, a start-up shim (written to a temporary folder on PYTHONPATH, for
this check only) gives it a custom Ray resource as the device and device id 0 per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESOURCE = "ouroboros_check_device"
# vLLM's two Ray executors, chosen by VLLM_USE_RAY_V2_EXECUTOR_BACKEND.
EXECUTORS = {"RayExecutorV2": "1", "RayDistributedExecutor": "0"}

# Loaded at every interpreter start of this check (engine core, Ray workers): patches vLLM's
# modules when they are imported, so Ray's own processes do not import vLLM.
SHIM = textwrap.dedent(f'''
    import importlib.abc, importlib.util, os, sys


    def _device_ids(self):  # module level: the patched actor class is pickled by reference to it
        import ray
        return ray.get_runtime_context().get_node_id(), [0]


    def _cpu(m):
        m.CpuPlatform.ray_device_key = "{RESOURCE}"


    def _v2(m):
        m.RayWorkerProc.get_node_and_physical_gpu_ids = _device_ids


    def _utils(m):
        if hasattr(m, "RayWorkerWrapper"):
            m.RayWorkerWrapper.get_node_and_physical_gpu_ids = _device_ids


    def _no_fix(m):
        if os.environ.get("OUROBOROS_CHECK_NO_FIX"):
            m.apply_engine_core = lambda: None


    PATCHES = {{"vllm.platforms.cpu": _cpu, "vllm.v1.executor.ray_executor_v2": _v2,
               "vllm.v1.executor.ray_utils": _utils,
               "vllm_ouroboros.patches.engine_shutdown": _no_fix}}


    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in PATCHES or (name != "vllm_ouroboros.patches.engine_shutdown"
                                       and not os.environ.get("OUROBOROS_CHECK_CPU_RAY")):
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                PATCHES[name](module)

            spec.loader.exec_module = exec_module
            return spec


    sys.meta_path.insert(0, _Hook())
''')


def engine_run(out: Path) -> None:
    """In the child process (the shim loaded): one Ray engine, two batches, its shutdown."""
    import gc

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import model_pair
    from vllm import LLM, SamplingParams

    from vllm_ouroboros.metrics import engine_snapshot
    from vllm_ouroboros.pool import PhrasePool

    models = model_pair(out / "models")
    pool = out / "pool.pt"
    # No save when idle: the file would hold the last pool before the shutdown's save.
    spec = {"method": "ouroboros", "model": str(models["draft"]), "pool_save_path": str(pool),
            "pool_save_on_idle": False, "use_lookahead": True, "use_guesses": True, "use_suffixes": True}
    llm = LLM(model=str(models["target"]), dtype="float32", enforce_eager=True, seed=0,
              max_num_seqs=8, max_model_len=512, speculative_config=spec,
              distributed_executor_backend="ray")
    greedy = SamplingParams(temperature=0, max_tokens=64)
    llm.generate([[5, 6, 7, 8, 9, 10] * 3] * 4 + [list(range(20, 32))], greedy, use_tqdm=False)
    time.sleep(11)  # past the periodic save's interval
    llm.generate([list(range(40, 70))] * 3, SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
    last = engine_snapshot(llm)["pool"]["keys"]

    def keys() -> int | None:
        return int((PhrasePool.read_state(str(pool))["page_key"] >= 0).sum()) if pool.exists() else None

    before = keys()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    (out / "result.json").write_text(json.dumps(
        {"snapshot_keys": last, "file_keys_before_shutdown": before, "file_keys_after_shutdown": keys()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fix", action="store_true", help="leave out the engine core's save (shows the failure)")
    ap.add_argument("--executors", nargs="+", default=["RayExecutorV2", "RayDistributedExecutor"],
                    choices=list(EXECUTORS))
    ap.add_argument("--engine", type=Path, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.engine is not None:
        engine_run(args.engine)
        return 0
    try:
        import ray  # noqa: F401
    except ImportError:
        print("ray is not installed: pip install ray (vLLM's Ray executors need it)", file=sys.stderr)
        return 2
    import ray.util
    import torch

    work = Path(tempfile.mkdtemp(prefix="ray_pool_save_"))
    (work / "shim").mkdir()
    (work / "shim" / "sitecustomize.py").write_text(SHIM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work / "shim"), str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]),
           "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "auto",
           # RayDistributedExecutor places its first worker on the node at vLLM's host address.
           "VLLM_HOST_IP": ray.util.get_node_ip_address(),
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if not torch.cuda.is_available():
        env["OUROBOROS_CHECK_CPU_RAY"] = "1"
    if args.no_fix:
        env["OUROBOROS_CHECK_NO_FIX"] = "1"
    cpus = str(max(1, len(os.sched_getaffinity(0))))
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run([*ray_cli, "start", "--head", "--num-cpus", cpus, "--resources",
                    json.dumps({RESOURCE: int(cpus)}), "--node-ip-address", env["VLLM_HOST_IP"],
                    "--include-dashboard=false", "--disable-usage-stats"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    failed = 0
    try:
        for name in args.executors:
            out = work / name
            out.mkdir()
            subprocess.run([sys.executable, __file__, "--engine", str(out)], check=True,
                           env={**env, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": EXECUTORS[name]})
            result = json.loads((out / "result.json").read_text())
            ok = result["file_keys_after_shutdown"] == result["snapshot_keys"]
            failed += not ok
            print(f"{name}{' (no engine-core save)' if args.no_fix else ''}: pool file "
                  f"{result['file_keys_before_shutdown']} keys before the engine's shutdown, "
                  f"{result['file_keys_after_shutdown']} after; the engine's last snapshot "
                  f"{result['snapshot_keys']} keys -> {'OK' if ok else 'STALE'}", flush=True)
    finally:
        subprocess.run([*ray_cli, "stop", "--force"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
