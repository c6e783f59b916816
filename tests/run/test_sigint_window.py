"""Ctrl-C while xpar starts its fork server (xpar.run.forkserver.sigint_blocked): ignored there, so that the
server never prints a traceback, but not lost by the launcher."""
import signal
import subprocess
import sys
import threading

import pytest

from xpar.run.forkserver import sigint_blocked


def test_a_ctrl_c_inside_the_window_is_raised_when_it_ends():
    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with sigint_blocked():
            # to this thread (a process-wide Ctrl-C may be taken by another thread: raised at once, also not lost)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            reached_end = True  # the window goes on: the server's start is not cut short
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # never ignored: a Ctrl-C cannot be lost
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


@pytest.mark.slow
def test_the_server_lifts_the_block_it_inherits_and_drops_the_pending_ctrl_c():
    # a child started inside the window (as the fork server is: fork + exec) inherits SIGINT ignored and blocked;
    # importing xpar.run.quiet_server leaves it ignored, unblocked and with nothing pending
    code = ("import os, signal; os.kill(os.getpid(), signal.SIGINT); "
            "assert signal.SIGINT in signal.sigpending(); import xpar.run.quiet_server; "
            "assert signal.SIGINT not in signal.sigpending(); "
            "assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set()); "
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN; print('ok')")
    with sigint_blocked():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_the_fork_server_is_started_with_ctrl_c_blocked():
    # the stdlib's resource tracker, which the server's start starts, unblocks SIGINT after its own start
    # (resource_tracker.ensure_running): xpar starts it first, so the server's exec still holds the block
    code = ("import signal, multiprocessing.util as u; spawn = u.spawnv_passfds\n"
            "def spy(path, args, fds):\n"
            "    print(any('forkserver' in str(a) for a in args), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))\n"
            "    return spawn(path, args, fds)\n"
            "u.spawnv_passfds = spy\n"
            "from xpar.run.forkserver import start_server; start_server(('xpar.run.quiet_server',))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "True True" in out.stdout.splitlines(), out.stdout
