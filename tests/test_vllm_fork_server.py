"""The vLLM tests' fork server (tests/vllm_fork_server.py) gives each script what ``python -c``
would: a process of its own, nothing of the plugin imported, the script's environment, exit code,
output and timeout - and nothing left from the script before it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import vllm_support
from vllm_support import require_vllm, run_python

pytestmark = require_vllm()

_STATE = """
import json, os, sys
print(json.dumps(dict(
    name=__name__, argv=sys.argv, path0=sys.path[0], file="__file__" in globals(),
    plugin=sorted(m for m in sys.modules if m.startswith(("qwen4exp_ext", "vllm.models"))),
    ppid=os.getppid(), pid=os.getpid(), cwd=os.getcwd(),
    env={k: os.environ.get(k) for k in ("QWEN4EXP_PROBE", "VLLM_PLUGINS")},
)))
"""


def _state(**env: str) -> dict:
    return json.loads(run_python(_STATE, env=env).strip().splitlines()[-1])


@pytest.fixture
def server():
    if os.environ.get("QWEN4EXP_TEST_FORK_SERVER") == "0":
        pytest.skip("the fork server is turned off (QWEN4EXP_TEST_FORK_SERVER=0)")
    pid = _state()["ppid"]  # starts it
    servers = [s for s in vllm_support._fork_servers if s.process.pid == pid]
    assert servers, "the script did not run in a fork server"
    return servers[0]


def test_a_script_starts_as_python_c_would_in_a_process_of_its_own(server):
    first = _state(QWEN4EXP_PROBE="1", VLLM_PLUGINS="qwen4exp")
    second = _state()
    assert first["ppid"] == server.process.pid  # forked by the server, not started afresh
    assert first["pid"] != second["pid"]
    for state in (first, second):
        assert state["name"] == "__main__" and state["argv"] == ["-c"]
        assert state["path0"] == "" and not state["file"]
        assert state["plugin"] == []
        assert state["cwd"] == os.getcwd()
    assert first["env"] == {"QWEN4EXP_PROBE": "1", "VLLM_PLUGINS": "qwen4exp"}
    assert second["env"] == {"QWEN4EXP_PROBE": None, "VLLM_PLUGINS": None}


def test_nothing_a_script_loads_is_left_to_the_next(server):
    loaded = """
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    import vllm.models.qwen4_exp.common.ngram_embedding
    import qwen4exp_ext.vllm
    print(qwen4exp_ext.vllm.swapped() != [])
    """
    assert run_python(loaded, env={"VLLM_PLUGINS": "qwen4exp"}).strip().endswith("True")
    assert _state()["plugin"] == []


def test_exit_code_output_and_errors_come_back(server):
    out = run_python("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)")
    assert out == "to stdout\n"
    with pytest.raises(pytest.fail.Exception, match=r"(?s)failed \(3\).*partial.*went wrong"):
        run_python("import sys\nprint('partial')\nsys.stderr.write('went wrong')\nsys.exit(3)")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)failed \(1\).*ValueError: raised"):
        run_python("raise ValueError('raised')")


def test_a_script_past_its_timeout_is_killed_and_the_server_serves_on(server):
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("import time\ntime.sleep(120)", timeout=2)
    assert _state()["ppid"] == server.process.pid


def test_an_environment_the_imports_read_gets_a_server_of_its_own_or_a_fresh_interpreter(
    server, monkeypatch
):
    # OMP_NUM_THREADS is read when torch loads: the first server's copy would not see it.
    threads = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    state = _state(OMP_NUM_THREADS=threads)
    assert state["ppid"] != server.process.pid
    if state["ppid"] != os.getpid():  # a second server, started with that environment
        other = [s for s in vllm_support._fork_servers if s.process.pid == state["ppid"]]
        assert other and other[0].env["OMP_NUM_THREADS"] == threads
    # No more servers than the cap: a third environment starts a fresh interpreter.
    monkeypatch.setattr(vllm_support, "_MAX_FORK_SERVERS", len(vllm_support._fork_servers))
    assert _state(OMP_NUM_THREADS=threads + "1")["ppid"] == os.getpid()


def test_what_vllms_import_sets_in_this_process_still_forks():
    """Once a test imports vLLM here, its import-time overrides (TORCHINDUCTOR_*, ...) are in
    this process's environment as in the server's: the script is still forked, and sees them.
    A server of the test's own, started from an environment without them (whether this process
    has imported vLLM yet depends on the tests before)."""
    set_by_vllm = ("TORCHINDUCTOR_", "PYTORCH_NVML", "TRITON_", "TILELANG_")
    base = vllm_support._script_env(None)
    base = {k: v for k, v in base.items() if not k.startswith(set_by_vllm)}
    server = vllm_support._ForkServer(base)
    try:
        assert server.imported, "vLLM's import set no variable: nothing to check"
        for env in (base, {**base, **server.imported}):
            assert server.serves(env)
            code, out, err = server.run(
                "import json, os\nprint(json.dumps([os.getppid(), dict(os.environ)]))", env, 60
            )
            assert code == 0, err
            ppid, seen = json.loads(out)
            assert ppid == server.process.pid
            assert all(seen.get(k) == v for k, v in server.imported.items())
        assert not server.serves({**base, next(iter(server.imported)): "another value"})
    finally:
        server.close()
