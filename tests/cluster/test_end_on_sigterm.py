"""A test run stopped by SIGTERM (a CI timeout or cancel, a process group stopped) tears its
fixtures down as Ctrl-C does, so the clusters they started do not outlive it and block the
next run ("one cluster per machine")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import conveyor

CONFTEST = """
from conveyor.cluster.testing import end_on_sigterm


def pytest_configure(config):
    end_on_sigterm()
"""

TEST = """
import threading
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cluster():
    yield
    Path("torn-down").write_text("the cluster's teardown ran")


def test_long(cluster):
    Path("started").write_text("")
    threading.Event().wait(120)  # until the run is stopped
"""


def test_a_sigterm_tears_the_session_fixtures_down(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_stopped.py").write_text(TEST)
    # the child imports the same conveyor as this run, installed or from a checkout
    source = str(Path(conveyor.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".",
         "test_stopped.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "the test never started"
            time.sleep(0.05)  # polling for the child's file, not ordering work
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert (tmp_path / "torn-down").read_text() == "the cluster's teardown ran", output
    assert run.returncode == 2, output  # pytest's "interrupted"
