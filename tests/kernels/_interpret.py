"""Run a kernel test module as a script under TRITON_INTERPRET=1 and read its JSON verdicts.

Triton reads TRITON_INTERPRET once, when it is first imported, so interpreted
kernels need a process where the variable is set before that; the test module's
``__main__`` block computes the results there and prints them as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tierkv import kernels


def interpreted(test_file: str) -> dict:
    """The JSON dict ``python test_file`` prints last, run with the interpreter on."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != kernels.ENV_VAR} | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
