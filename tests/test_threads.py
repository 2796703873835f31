"""One compute thread: in a served process, every torch op that computes runs on the `tinyserve-engine` thread,
from loading the weights to the last step and the tier copies. Other threads may only make views of bytes (the
file tier's reader) or read tensor metadata. Two threads running torch ops start two OpenMP teams, and on a small
CPU both crawl (84 -> 54 tokens/s measured), so this is a correctness property of the serving path.

A fresh process records, with a profile hook on every thread, each call into torch's C functions and the thread
that made it, while it loads the demo model, serves chat and completion requests through the real HTTP server
(prefix cache with the host and file tiers on), flushes the cache and stops.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys, threading
calls = {}

def hook(frame, event, arg):
    if event == "c_call":
        owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__
        if owner and owner.startswith("torch"):
            key = (threading.current_thread().name, getattr(arg, "__name__", "?"))
            calls[key] = calls.get(key, 0) + 1

sys.path.insert(0, sys.argv[1])
from server_util import InProcessServer, free_port, http, server_config
from tinyserve import api, config, demo, engine, loader   # imported first: imports register, they do not compute
sys.setprofile(hook)
threading.setprofile(hook)

data = server_config(free_port(), {"cache": {"host": {"size_gb": 0.01}, "file": {"dir": sys.argv[2], "size_gb": 1}}})
with InProcessServer(config.from_dict(data)) as srv:
    for path, body in [("/v1/completions", {"prompt": list(range(3, 120)), "max_tokens": 8}),
                       ("/v1/completions", {"prompt": list(range(3, 120)), "max_tokens": 8}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                 "stream": True})]:
        status, _, raw = http("POST", srv.base_url + path, body)
        assert status == 200, raw
    assert http("POST", srv.base_url + "/flush_cache?tiers=file")[0] == 200
    assert http("GET", srv.base_url + "/metrics")[0] == 200
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps([[t, f, n] for (t, f), n in calls.items()]))
"""

# What a thread other than the compute thread may call: metadata and views of existing bytes, no arithmetic.
NON_COMPUTE = {"frombuffer", "view", "reshape", "numpy", "contiguous", "is_contiguous", "element_size", "dim",
               "size", "numel", "is_available", "device_count", "empty", "get_default_dtype", "is_tensor",
               "_is_functional_tensor", "is_grad_enabled", "is_inference_mode_enabled", "__len__", "__getitem__",
               "__subclasshook__", "__instancecheck__", "_get_tracing_state", "is_storage", "is_floating_point",
               "is_complex", "_has_torch_function", "_has_torch_function_unary", "_has_torch_function_variadic"}


@pytest.mark.slow
def test_all_torch_compute_runs_on_the_engine_thread(tmp_path, xdg):
    tests = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tests), str(tmp_path / "kv")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "XDG_CACHE_HOME": str(xdg)})
    assert out.returncode == 0, out.stderr[-3000:]
    calls = json.loads(out.stdout.strip().splitlines()[-1])
    engine = {f for t, f, _ in calls if t == "tinyserve-engine"}
    assert {"index_copy_", "copy_"} & engine, "the engine thread ran the model and the tier copies"
    elsewhere = sorted({(t, f) for t, f, _ in calls if t != "tinyserve-engine" and f not in NON_COMPUTE})
    assert not elsewhere, f"torch compute outside the engine thread: {elsewhere}"
