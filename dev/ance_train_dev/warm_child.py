"""A process for tests/test_warm_start.py to start from the zygote (``python -m
ance_train_dev.warm_child ACTION [ARG]``): it prints, as one JSON line on stdout, what a cold
``python -m`` start would also have given it (argv, working directory, environment, session,
random draws, which preloaded modules it found), then does ACTION: ``exit CODE``, ``sleep``
(until killed), ``raise`` (an uncaught exception) or ``stderr TEXT``."""

from __future__ import annotations

import json
import os
import random
import sys
import time

PRELOADED_PROBE = "decimal"  # the tests preload it; nothing here imports it


def main() -> None:
    action, *rest = sys.argv[1:]
    import numpy

    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid(),
        "sid": os.getsid(0), "found_preloaded": PRELOADED_PROBE in sys.modules,
        "random": random.random(), "numpy_random": float(numpy.random.random()),
        "stdin": sys.stdin.read()}))
    if action == "exit":
        sys.exit(int(rest[0]))
    if action == "sleep":
        while True:
            time.sleep(1)
    if action == "raise":
        raise RuntimeError("the child's own error")
    if action == "stderr":
        print(rest[0], file=sys.stderr)


if __name__ == "__main__":
    main()
