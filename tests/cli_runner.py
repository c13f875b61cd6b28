"""The ``hyper-gen`` CLI run inside the test process: ``main(argv)`` with its output captured.

A subprocess pays 10-30 s of framework imports per command on a loaded 2-core machine; what most CLI
tests check (exit status, what is printed, what a JSONL job writes) does not need the process boundary.
Those that do (the console script, a signal, MindSpore's import-time log level) keep ``subprocess``.

Output is captured at the file-descriptor level (pytest's ``capfd``), so a C++ log line or a warning
written by a logging handler bound to the real stderr is seen, as it would be from a subprocess. The
state a run can leave behind in this process is put back after it: the environment (``main`` sets log
levels with ``os.environ.setdefault``), transformers' progress bars, torch's intra-op thread count, and
``sys.stdin``.
"""

import io
import logging
import os
import subprocess
import sys

from hyper_gen.cli import main


class InProcessCLI:
    def __init__(self, capfd, monkeypatch):
        self.capfd, self.monkeypatch = capfd, monkeypatch
        # transformers reads TRANSFORMERS_VERBOSITY when it first configures its logger: do that now,
        # from the suite's own environment, not from whatever a run sets
        import transformers  # noqa: F401

    def __call__(self, args, stdin=None, env=None):
        """CompletedProcess of ``hyper-gen args`` (``env``: variables set for this run only, like a
        subprocess's; the subprocess tests run with ``OMP_NUM_THREADS=1``, so torch runs one thread)."""
        import torch

        args = [str(a) for a in args]
        saved_env, threads, saved_stdin = dict(os.environ), torch.get_num_threads(), sys.stdin
        self.capfd.readouterr()  # what the test printed before belongs to no run
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        sys.stdin = io.StringIO(stdin or "")
        torch.set_num_threads(1)
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()  # a quiet run switches them off (jobs/logs.py)
        for handler in hf_logging.get_logger().handlers:  # bound to the stderr of the run that configured it
            # only transformers' own handler (a plain StreamHandler): pytest >= 9.1 also attaches its
            # log-capture handlers (StreamHandler subclasses over a StringIO it reads back with
            # getvalue()) to every non-propagating logger, transformers' included
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr  # (setStream would flush the closed one)
        try:
            code = main(args)
        except SystemExit as exc:  # argparse: --help, --version, a flag it rejects
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        finally:
            sys.stdin = saved_stdin
            if bars and not hf_logging.is_progress_bar_enabled():
                hf_logging.enable_progress_bar()
            torch.set_num_threads(threads)
            os.environ.clear()
            os.environ.update(saved_env)
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = self.capfd.readouterr()
        return subprocess.CompletedProcess(["hyper-gen", *args], code, out, err)
