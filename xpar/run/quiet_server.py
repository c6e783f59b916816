"""Imported first by the fork server (:data:`xpar.run.forkserver.WORKER_PRELOAD`), and nowhere else:
the server ignores Ctrl-C from here on. It shares xpar's process group and terminal, and a Ctrl-C
while it imports torch would print its own traceback beside xpar's one line; Python's fork server
ignores SIGINT only once its imports are done. Each worker restores Python's default handler
(:func:`xpar.run.forkserver.in_callers_env`)."""
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
