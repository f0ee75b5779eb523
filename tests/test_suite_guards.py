"""The test suite's own guards: a hung test fails with its stacks instead of stalling the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_every_test_has_a_time_limit(request):
    assert 0 < float(request.config.getini("timeout")) <= 600


def test_a_hung_test_fails_with_its_stack_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import threading

        def test_hangs():
            threading.Event().wait()  # blocks in C, as a hung collective would

        def test_after():
            pass
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "timeout=2", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 1, out.stdout
    assert "Timeout" in out.stdout and "test_hangs" in out.stdout
    assert "1 failed, 1 passed" in out.stdout
