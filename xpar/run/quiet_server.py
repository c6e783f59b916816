"""Imported first by the fork server (:data:`xpar.run.forkserver.WORKER_PRELOAD`), and nowhere else:
the server ignores Ctrl-C from here on. It shares xpar's process group and terminal, and a Ctrl-C
while it imports torch would print its own traceback beside xpar's one line; Python's fork server
ignores SIGINT only once its imports are done. Each worker restores Python's default handler
(:func:`xpar.run.forkserver.in_callers_env`). The server starts with SIGINT blocked
(:func:`xpar.run.forkserver.sigint_blocked`): ignoring it drops a Ctrl-C pending from its imports (sigaction to
SIG_IGN discards a pending signal), then the block is lifted so that its workers inherit none."""
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
